"""Fleet figures on the default model: step counts, held-out loss isolated and co-loaded,
retrieval top-1 accuracy, and the collapse check (p_iso 1.0 vs 0.75, distractors trained vs frozen).

Each arm trains its own fleet of the same documents from the same corpus-init cartridges;
"init" is the untrained fleet (rounds 0). Co-loaded losses put 2 distractors beside the
target (chosen and placed by a keyed draw per document, the same in every arm).
Run: `python -m experiments.measure_fleet --out DIR [--seeds 7] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from cartridges.core.models import load_model
from cartridges.fleet import Fleet
from jobs.fleet import run_fleet
from schemas.presets import fleet_preset
from stages import fleet_data
from storage import Store

DOCS = ["README.md", "docs/PIPELINE.md", "docs/corpus/deflate.md", "docs/eval/raft.md"]
BUDGET = {"p": 64, "budget": 3, "rotate_every": 4, "rounds": 8, "accum": 2, "lr": 5e-3, "warmup": 4,
          "chunk_min": 128, "chunk_max": 256, "heldout": 3, "embed_chunk": 256,
          "synth": {"max_q": 32, "max_a": 64, "gen_batch": 8}}
ARMS = {
    "init": {"rounds": 0},
    "p_iso=0.75 trained": {"p_iso": 0.75, "distractors": "train"},
    "p_iso=1.0": {"p_iso": 1.0},
    "p_iso=0.75 frozen": {"p_iso": 0.75, "distractors": "frozen"},
}


def arm_dir(out: Path, seed: int, arm: str) -> Path:
    """Where an arm's fleet lives under a measurement's output directory."""
    return out / f"seed{seed}-{arm.replace(' ', '-').replace('=', '')}"


def retrieval(store: Store, lm, fleet_dir: Path, cfg) -> dict:
    """Top-1 accuracy of held-out bot A questions (from each document's reserved tail)."""
    fleet = Fleet.open(fleet_dir, lm)
    hits, total, misses = 0, 0, []
    for entry in fleet.manifest.documents:
        doc = next(Path(d) for d in DOCS if Path(d).name == entry.name)
        ids = lm.tokenizer(doc.read_text(), add_special_tokens=False)["input_ids"]
        art = fleet_data.heldout_data(store, lm, {"doc_id": entry.doc_id, "name": entry.name, "sha256": entry.sha256,
                                                  "token_ids": ids}, cfg, lm.compute_id)
        for conv in store.table(art, "conversations").to_pylist():
            if not conv["question"].strip():
                continue
            top = fleet.select(conv["question"], k=1)
            total += 1
            hits += top == [entry.name]
            if top != [entry.name]:
                misses.append((entry.name, conv["question"][:80], top))
    return {"top1": hits / max(1, total), "n": total, "misses": misses}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="artifacts/measure-fleet")
    ap.add_argument("--seeds", type=int, nargs="+", default=[7])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    lm = load_model(None, None)
    store = Store(out / "store")
    results = []
    for seed in args.seeds:
        for arm, changes in ARMS.items():
            cfg = fleet_preset("default", {**BUDGET, **changes, "seed": seed})
            directory = arm_dir(out, seed, arm)
            start = time.perf_counter()
            s = run_fleet(store, lm, DOCS, directory, cfg, resume=(directory / "fleet.json").exists(),
                          eval_distractors=2, log=lambda line: print(line, flush=True))
            row = {"seed": seed, "arm": arm, "seconds": time.perf_counter() - start,
                   "documents": [{k: d.get(k) for k in ("name", "steps", "heldout_before", "heldout_after",
                                                         "heldout_coloaded")} for d in s["documents"]]}
            if arm == "p_iso=0.75 trained":
                row["retrieval"] = retrieval(store, lm, directory, cfg)
            results.append(row)
            print(json.dumps(row), flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
