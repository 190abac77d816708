"""Fleet quality on the eval documents: each document's multiple-choice questions answered
behind its own cartridge alone and behind the whole fleet composed, for each
mixed-visibility training arm, scored by the correct option's NLL as `cartridges eval` does.

Held-out loss (experiments.measure_fleet) cannot see whether a composed cartridge still answers
about its document; the gold NLL's gap closure (bare 0, document in context 1) can, so a
composition collapse, and the trained or frozen distractors' rescue of it, shows here or not
at all. Every arm trains its own fleet of the same documents from the same corpus-init
cartridges and the same synthetic data (the round artifacts are shared through the store);
training runs in `--dtype` and scoring in float32, as the single-cartridge curve does.

Run: `python -m experiments.fleet_quality --out DIR [--seeds 7] [--rounds 75] [--json]`; a rerun
continues a crashed arm's fleet to its rounds and keeps finished arms. It prints each arm's
closures, then paired closure changes (questions resampled within each document): composed
against alone in every arm, and each mixed-visibility arm against isolated training.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from cartridges.core.models import load_model
from cartridges.evaluation.evaluate import Arm, closure, score_arm
from cartridges.evaluation.qa import read_questions
from cartridges.fleet import Fleet
from cartridges.fleet.manifest import read_manifest
from experiments.curve import pooled, question_changes
from experiments.measure_fleet import ARMS, arm_dir
from jobs.fleet import run_fleet
from schemas.presets import fleet_preset
from stages.evaluate import Inputs, read_docs, select_questions
from storage import Store, atomic_write_bytes

DOCS = ["docs/eval/raft.md", "docs/eval/panama.md", "docs/eval/photosynthesis.md"]
QA = "docs/eval/questions.jsonl"
# 8 conversations a round, 75 rounds: about 200 conversations a document over 3 documents,
# at the single cartridge's lr (docs/QUALITY.md); every document stays resident (budget 3).
BUDGET = {"p": 256, "budget": 3, "rotate_every": 10, "rounds": 75, "accum": 8, "lr": 2e-2, "warmup": 8,
          "heldout": 4, "synth": {"gen_batch": 8}}


def _closures(scored: dict, doc: str, arm: str) -> dict:
    mine = {name: [s for s in rows if s.question.doc == doc] for name, rows in scored.items()}
    nll = closure(mine, arm, "gold_nll")
    acc = [float(s.correct) for s in mine[arm]]
    return {"nll_closure": nll["value"], "nll_closure_ci": nll["ci"], "accuracy": statistics.mean(acc),
            "gold_nll": statistics.mean(s.gold_nll for s in mine[arm]), "questions": len(acc)}


def evaluate(lm, directory: Path, docs: dict[str, str], questions: list, reference: dict) -> dict:
    """Per document: closure alone (its own cartridge) and composed (every fleet cartridge), and
    each question's gold NLL on every arm (by its index in `questions`) for paired comparisons."""
    fleet = Fleet.open(directory, lm)
    alone = Arm("alone", key=lambda q: q.doc, rows=lambda q: fleet.rows([q.doc]))
    composed = Arm("composed", key=lambda q: "all", rows=lambda q: fleet.rows(fleet.names))
    scored = dict(reference)
    for arm in (alone, composed):
        scored[arm.name], _ = score_arm(lm, arm, questions, likelihood_only=True)
    out = {doc: {arm: _closures(scored, doc, arm) for arm in ("alone", "composed")} for doc in docs}
    for doc in docs:
        out[doc]["by_question"] = {str(i): {name: rows[i].gold_nll for name, rows in scored.items()}
                                   for i, q in enumerate(questions) if q.doc == doc}
    return out


def change(base: dict, other: dict, base_arm: str, other_arm: str) -> dict:
    """Closure change from (base run, base_arm) to (other run, other_arm), pooled over the documents
    with equal weight, questions resampled within each (experiments.curve.pooled)."""
    changes = []
    for doc, cell in base["documents"].items():
        a = {int(i): {"cartridge": v[base_arm], "bare": v["bare"], "icl": v["icl"]}
             for i, v in cell["by_question"].items()}
        b = {int(i): {"cartridge": v[other_arm]} for i, v in other["documents"][doc]["by_question"].items()}
        changes.append(question_changes(a, b))
    return pooled(changes)


def comparisons(runs: list[dict]) -> list[dict]:
    """What composing costs in each arm, and what each mixed-visibility arm buys over isolated training."""
    out = []
    for seed in sorted({r["seed"] for r in runs}):
        mine = {r["arm"]: r for r in runs if r["seed"] == seed}
        for arm, run in mine.items():
            out.append({"seed": seed, "what": f"{arm}: composed against alone",
                        **change(run, run, "alone", "composed")})
        base = mine.get("p_iso=1.0")
        for arm in ("p_iso=0.75 trained", "p_iso=0.75 frozen"):
            if base and arm in mine:
                for cond in ("alone", "composed"):
                    out.append({"seed": seed, "what": f"{arm} against p_iso=1.0, {cond}",
                                **change(base, mine[arm], cond, cond)})
    return out


def train_arm(store: Store, lm, directory: Path, cfg) -> float:
    """Train the arm's fleet up to `cfg.rounds` rounds in all (a rerun continues a crashed one)."""
    have = read_manifest(directory).rounds if (directory / "fleet.json").exists() else 0
    start = time.perf_counter()
    run_fleet(store, lm, DOCS, directory, cfg.replace(rounds=max(0, cfg.rounds - have)),
              resume=(directory / "fleet.json").exists(), log=lambda line: print(line, flush=True))
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="artifacts/fleet-quality")
    ap.add_argument("--seeds", type=int, nargs="+", default=[7])
    ap.add_argument("--rounds", type=int, default=BUDGET["rounds"])
    ap.add_argument("--dtype", default="bfloat16", help="training dtype (scoring is float32)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    done = {(r["seed"], r["arm"]): r for r in map(json.loads, results_path.read_text().splitlines())} \
        if results_path.exists() else {}
    docs = read_docs(DOCS)
    questions, _ = select_questions(read_questions(QA)[0], docs)
    questions = [q for q in questions if q.multiple_choice]
    train_lm, eval_lm = load_model(None, None, args.dtype), load_model(None, None, "float32")
    inputs = Inputs(eval_lm, [], docs)
    reference = {arm.name: score_arm(eval_lm, arm, questions, likelihood_only=True)[0]
                 for arm in inputs.arms(peers=False) if arm.name in ("bare", "icl")}
    store = Store(out / "store")
    for seed in args.seeds:
        for arm, changes in ARMS.items():
            row = done.get((seed, arm))
            if row and all("by_question" in d for d in row["documents"].values()):
                continue
            rounds = {"rounds": args.rounds} if changes.get("rounds") is None else {}
            cfg = fleet_preset("default", {**BUDGET, **rounds, **changes, "seed": seed})
            directory = arm_dir(out, seed, arm)
            trained = row["train_seconds"] if row else train_arm(store, train_lm, directory, cfg)
            start = time.perf_counter()
            row = {"seed": seed, "arm": arm, "rounds": cfg.rounds, "train_seconds": trained,
                   "documents": evaluate(eval_lm, directory, docs, questions, reference),
                   "eval_seconds": time.perf_counter() - start}
            done[(seed, arm)] = row
            atomic_write_bytes(results_path, "".join(json.dumps(r) + "\n" for r in done.values()).encode())
            print(json.dumps({k: v for k, v in row.items() if k != "documents"}), flush=True)
    runs = [done[k] for k in sorted(done, key=lambda k: (k[0], list(ARMS).index(k[1])))]
    for r in runs:
        cells = [f"{d}: {v['alone']['nll_closure']:.2f} alone, {v['composed']['nll_closure']:.2f} composed"
                 for d, v in r["documents"].items()]
        print(f"seed {r['seed']} {r['arm']}: " + "; ".join(cells))
    found = comparisons(runs)
    for c in found:
        ci = c["closure_change_ci"]
        print(f"seed {c['seed']} {c['what']}: closure {c['closure_change']:+.3f} ({ci[0]:+.3f} to {ci[1]:+.3f})")
    if args.json:
        print(json.dumps({"runs": runs, "comparisons": found}))


if __name__ == "__main__":
    main()
