"""Where cartridges matter: corpora longer than the window, against retrieval and compression at equal rows.

Each long corpus of `docs/eval/long/` (2.5-10 windows of the default model, 6-10 documents)
is answered with the same KV budget by every arm: retrieval (BM25 and dense chunks in
context), the corpus's first rows (`icl_truncated`, the same computation as `first`),
the compression peers over the corpus cut to the window (knorm, snapkv), a monolithic
cartridge trained on the whole corpus, a per-document fleet (isolated and mixed-visibility
training; retrieval composing `K` cartridges, and the oracle pick) and a fleet cartridge
beside retrieved chunks in the same budget. References: bare, the corpus cut to the
window (`icl_window`) and the question's own document in context (`icl_oracle`, the
ceiling that closure is measured against). The docs/eval/ documents run the same way as
one-document corpora (`eval:raft`).

A point is one (corpus, budget, arm, seed); each finished point is a line of
`OUT/<corpus>.jsonl` with every question's correct-option NLL and correctness, so the
table's intervals and paired differences are computed from the records; `fleet_rag` at a
budget is also paired with `rag` at half of it, its chunks without the cartridge. A rerun skips
finished points; training keeps its store (synthesis is shared between budgets and
between a fleet's arms), so an interrupted point continues.

    python -m experiments.long_table run [--corpora packaging-peps ...] [--budgets 512 2048]
        [--arms ...] [--seeds 7] [--conversations 256] [--out docs/quality/long] [--store artifacts/long] [--json]
    python -m experiments.long_table table [--out docs/quality/long] [--markdown] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from experiments.curve import append_record, log

REPO = Path(__file__).resolve().parents[1]
LONG_DIR = REPO / "docs" / "eval" / "long"
EVAL_DIR = REPO / "docs" / "eval"
CORPORA = ("packaging-peps", "log-school-house", "chiriqui-report")
DEFAULT_OUT = "docs/quality/long"
DEFAULT_STORE = "artifacts/long"
K = 2  # fleet cartridges composed per question: each holds budget / K rows
REFERENCES = ("bare", "icl_oracle", "icl_window")  # budget-free: recorded once per corpus, budget 0
PEERS = ("icl_truncated", "knorm", "snapkv", "rag", "rag_dense")
TRAINED = ("cartridge", "fleet_iso", "fleet_iso_oracle", "fleet_mixed", "fleet_mixed_oracle", "fleet_rag")
CHUNKS = ("rag_c32", "rag_c64", "rag_c256")  # BM25 retrieval at other chunk sizes than the eval's 128
ARMS = REFERENCES + PEERS + TRAINED + CHUNKS
PRODUCT_NAME = {"icl_oracle": "icl", "icl_truncated": "first"}  # the eval's names for the same computations
CONVERSATIONS = 256  # a trained arm's self-study conversations unless --conversations says otherwise
FLEET = {"budget": 4, "rotate_every": 10, "accum": 8, "lr": 2e-2, "warmup": 8, "heldout": 4, "rag_docs": K,
         "synth": {"gen_batch": 8}}
VERSION = 1


def corpus_files(corpus: str) -> tuple[list[Path], Path]:
    """A long corpus's documents and question file; `eval:NAME` is one document of docs/eval/."""
    if corpus.startswith("eval:"):
        return [EVAL_DIR / f"{corpus[5:]}.md"], EVAL_DIR / "questions.jsonl"
    return sorted((LONG_DIR / corpus).iterdir()), LONG_DIR / f"{corpus}.jsonl"


def points(corpora: Sequence[str], budgets: Sequence[int], arms: Sequence[str], seeds: Sequence[int]) -> list[tuple]:
    """(corpus, budget, arm, seed): per corpus the references, then budget by budget the untrained
    peers and the trained arms, so that one budget's table is whole before the next starts."""
    out = []
    for corpus in corpora:
        out += [(corpus, 0, arm, 0) for arm in REFERENCES if arm in arms]
        for b in budgets:
            out += [(corpus, b, arm, 0) for arm in PEERS if arm in arms]
            out += [(corpus, b, arm, s) for s in seeds for arm in TRAINED if arm in arms]
            out += [(corpus, b, arm, 0) for arm in CHUNKS if arm in arms]
    return out


def read_points(path: Path) -> dict[tuple, dict]:
    """Finished points of one corpus file, by (corpus, budget, arm, seed, conversations)."""
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a write cut by a kill
        out[(r["corpus"], r["budget"], r["arm"], r["seed"], r["conversations"])] = r
    return out


class Corpus:
    """One corpus's documents, questions and arms, built on demand and kept for its points."""

    def __init__(self, name: str, eval_lm, train_lm, store: Path, conversations: int) -> None:
        from cartridges.evaluation.qa import read_questions
        from stages.evaluate import read_docs, select_questions

        self.name, self.eval_lm, self.train_lm, self.conversations = name, eval_lm, train_lm, conversations
        self.files, qa = corpus_files(name)
        self.docs = read_docs([str(f) for f in self.files])
        questions, _ = select_questions(read_questions(qa)[0], self.docs)
        self.questions = [q for q in questions if q.multiple_choice]
        self.store = store / name.replace(":", "-")
        self.inputs: dict[tuple, object] = {}  # by (budget, retrieval chunk)

    def at(self, budget: int, chunk: int | None = None):
        from stages.evaluate import RAG_CHUNK, Inputs

        key = (budget, chunk or RAG_CHUNK)
        if key not in self.inputs:
            self.inputs[key] = Inputs(self.eval_lm, [], self.docs, budget=budget or None, rag_chunk=key[1])
        return self.inputs[key]

    def train_cartridge(self, budget: int, seed: int) -> tuple[Path, dict]:
        """The monolithic cartridge (one store per seed: budgets share its synthesis)."""
        from jobs.pipeline import run_pipeline
        from schemas.presets import preset
        from storage import Store

        target = self.store / f"cartridge-s{seed}-n{self.conversations}-p{budget}.safetensors"
        config = preset("default", {"chunks": {"conversations": self.conversations},
                                    "train": {"p": budget, "seed": seed}})
        start = time.perf_counter()
        summary = run_pipeline(Store(self.store / f"mono-s{seed}"), self.train_lm, list(self.files), config,
                               save=target)
        stages = {s["stage"]: s["seconds"] for s in summary["stages"]}
        return target, {"wall_s": time.perf_counter() - start, "stage_seconds": stages,
                        "health": summary.get("health"), "dtype": summary.get("dtype")}

    def train_fleet(self, budget: int, seed: int, p_iso: float) -> tuple[Path, dict]:
        """A fleet of `budget / K`-row cartridges; the isolated and mixed arms share one store."""
        from cartridges.core.speed import dtype_name
        from cartridges.fleet.manifest import read_manifest
        from jobs.fleet import run_fleet
        from schemas.presets import fleet_preset
        from storage import Store

        directory = self.store / f"fleet-s{seed}-n{self.conversations}-p{budget // K}-iso{p_iso}"
        rounds = max(1, self.conversations // FLEET["accum"])
        started = (directory / "fleet.json").exists()  # a fleet prepared, perhaps with no round yet
        have = read_manifest(directory).rounds if started else 0
        config = fleet_preset("default", {**FLEET, "p": budget // K, "p_iso": p_iso, "seed": seed,
                                          "rounds": max(0, rounds - have)})
        start = time.perf_counter()
        if have < rounds:
            run_fleet(Store(self.store / f"fleet-s{seed}"), self.train_lm, list(self.files), directory, config,
                      resume=started, log=log)
        return directory, {"wall_s": time.perf_counter() - start, "rounds": rounds, "resumed_from": have,
                           "dtype": dtype_name(self.train_lm.dtype)}

    def arm(self, name: str, budget: int, seed: int):
        """The arm and what its training reported (None for untrained arms), or a reason it cannot run."""
        from cartridges.core.files import load_cartridge
        from cartridges.evaluation.evaluate import Arm
        from cartridges.fleet import Fleet

        inputs = self.at(budget)
        if name in REFERENCES or name in PEERS or name in CHUNKS:  # the eval's own arms, renamed
            if name == "icl_window" and len(self.docs) < 2:
                return None, None, "one-document corpus: icl_window is icl_oracle"
            wanted = PRODUCT_NAME.get(name, name)
            if name in CHUNKS:
                inputs, wanted = self.at(budget, int(name.removeprefix("rag_c"))), "rag"
            for arm in inputs.arms(peers=True, questions=self.questions):
                if arm.name == wanted:
                    arm.name = name
                    return arm, None, None
            return None, None, f"the eval builds no {wanted} arm here"
        lm = self.eval_lm
        if name == "cartridge":
            path, trained = self.train_cartridge(budget, seed)
            rows = load_cartridge(path, device=lm.device, dtype=lm.dtype).rows()
            return Arm(name, key=lambda q: "", rows=lambda q: rows), trained, None
        if len(self.docs) < 2:
            return None, None, "one-document corpus: a fleet has nothing to choose from"
        iso = 1.0 if name.startswith("fleet_iso") else 0.75
        directory, trained = self.train_fleet(budget, seed, iso)
        fleet = Fleet.open(directory, lm)
        picks: dict[str, list[str]] = {}

        def pick(q) -> list[str]:
            if q.question not in picks:
                picks[q.question] = fleet.select(q.question)
            return picks[q.question]
        if name.endswith("_oracle"):  # the question's own document first, then retrieval's next pick
            def oracle(q) -> list[str]:
                return [q.doc, *[d for d in pick(q) if d != q.doc]][:K]
            return Arm(name, key=lambda q: ",".join(oracle(q)), rows=lambda q: fleet.rows(oracle(q))), trained, None
        if name == "fleet_rag":  # the best document's cartridge, then chunks in the rows it leaves
            return inputs.rag_beside(name, lambda q: fleet.rows(pick(q)[:1])), trained, None
        return Arm(name, key=lambda q: ",".join(pick(q)), rows=lambda q: fleet.rows(pick(q))), trained, None


def score_point(corpus: Corpus, arm_name: str, budget: int, seed: int) -> dict:
    from cartridges.core.speed import dtype_name
    from cartridges.evaluation.evaluate import arm_ttft, score_arm, summarize_arm

    start = time.perf_counter()
    arm, trained, reason = corpus.arm(arm_name, budget, seed)
    record = {"version": VERSION, "corpus": corpus.name, "budget": budget, "arm": arm_name, "seed": seed,
              "conversations": corpus.conversations if arm_name in TRAINED else 0, "train": trained,
              "reason": reason}
    if arm is None:
        return record
    from stages.progress import progress

    lm = corpus.eval_lm
    scored_at = time.perf_counter()
    with progress(len(corpus.questions), f"{corpus.name} {budget} {arm_name}", "question") as bar:
        scored, _ = score_arm(lm, arm, corpus.questions, likelihood_only=True, progress=bar.update)
    summary = summarize_arm(lm, arm_name, scored, arm_ttft(lm, arm, corpus.questions), arm.notes)
    record.update({k: summary.get(k) for k in ("kv_rows", "kv_bytes", "ttft_s", "accuracy", "gold_nll")},
                  eval_s=time.perf_counter() - scored_at, wall_s=time.perf_counter() - start,
                  eval_dtype=dtype_name(lm.dtype),
                  questions=[{"line": s.question.line, "doc": s.question.doc, "region": s.question.region,
                              "correct": s.correct, "gold_nll": s.gold_nll, "kv_rows": s.kv_rows} for s in scored])
    return record


def run(corpora: Sequence[str], budgets: Sequence[int], arms: Sequence[str], seeds: Sequence[int],
        conversations: int, out: Path, store: Path, dtype: str) -> dict:
    from cartridges.core.models import load_model

    todo = points(corpora, budgets, arms, seeds)
    done = {}
    for corpus in corpora:
        done.update(read_points(out / f"{corpus.replace(':', '-')}.jsonl"))
    eval_lm = load_model(None, None, "float32")
    train_lm = load_model(None, None, dtype) if any(a in TRAINED for a in arms) else None
    loaded: dict[str, Corpus] = {}
    ran, skipped = [], []
    for i, (corpus, budget, arm, seed) in enumerate(todo, 1):
        n = conversations if arm in TRAINED else 0
        label = f"{corpus} budget {budget} {arm} seed {seed}" + (f" n {n}" if n else "")
        if (corpus, budget, arm, seed, n) in done:
            skipped.append(label)
            continue
        log(f"long: [{i}/{len(todo)}] {label}")
        if corpus not in loaded:
            loaded[corpus] = Corpus(corpus, eval_lm, train_lm, store, conversations)
        record = score_point(loaded[corpus], arm, budget, seed)
        append_record(out / f"{corpus.replace(':', '-')}.jsonl", record)
        ran.append(label)
        what = record["reason"] or (f"accuracy {record['accuracy']:.3f}, gold NLL {record['gold_nll']:.3f}, "
                                    f"{record['kv_rows']:.0f} rows, {record['wall_s'] / 60:.1f} min")
        log(f"long: {label}: {what}")
    return {"ran": ran, "skipped": len(skipped), "points": len(todo)}


# ---- the table


def _by_line(record: dict, field: str) -> dict[int, float]:
    return {q["line"]: float(q[field]) for q in record.get("questions") or [] if q.get(field) is not None}


def closure_of(arm: dict, bare: dict, ceiling: dict) -> dict:
    """Gold-NLL closure of `arm` against the ceiling, with a 95% interval resampling the questions."""
    from cartridges.evaluation.scoring import closure_ci

    a, b, c = (_by_line(r, "gold_nll") for r in (arm, bare, ceiling))
    lines = sorted(a.keys() & b.keys() & c.keys())
    if len(lines) < 2:
        return {"value": None, "ci": None}
    va, vb, vc = (np.array([-d[k] for k in lines]) for d in (a, b, c))
    gap = vc.mean() - vb.mean()
    if gap <= 0:
        return {"value": None, "ci": None, "reason": "the ceiling's gold NLL is not below bare"}
    ci, _ = closure_ci(va, vb, vc, 0.0)
    return {"value": float((va.mean() - vb.mean()) / gap), "ci": list(ci) if ci else None}


def paired(arm: dict, other: dict, bare: dict, ceiling: dict) -> dict:
    """`arm` minus `other` on the same questions: closure units of gold NLL, and accuracy, with intervals."""
    from cartridges.evaluation.scoring import bootstrap_ci

    a, o, b, c = (_by_line(r, "gold_nll") for r in (arm, other, bare, ceiling))
    lines = sorted(a.keys() & o.keys() & b.keys() & c.keys())
    gap = statistics.mean(b[k] - c[k] for k in lines) if lines else 0.0
    if len(lines) < 2 or gap <= 0:
        return {"closure": None, "closure_ci": None, "accuracy": None, "accuracy_ci": None}
    d_nll = [(o[k] - a[k]) / gap for k in lines]
    aa, oa = _by_line(arm, "correct"), _by_line(other, "correct")
    d_acc = [aa[k] - oa[k] for k in lines if k in aa and k in oa]
    return {"closure": statistics.mean(d_nll), "closure_ci": list(bootstrap_ci(d_nll)),
            "accuracy": statistics.mean(d_acc), "accuracy_ci": list(bootstrap_ci(d_acc))}


def accuracy_ci(record: dict) -> list[float]:
    from cartridges.evaluation.scoring import bootstrap_ci

    return list(bootstrap_ci([float(q["correct"]) for q in record["questions"]]))


def minutes(record: dict, records: Sequence[dict]) -> float | None:
    """Training minutes of a trained arm: its own training, plus the synthesis it shares with other
    points (taken from the point that ran it)."""
    train = record.get("train")
    if not train:
        return None
    if "stage_seconds" in train:
        own = train["stage_seconds"]
        shared = {}
        for r in records:
            s = (r.get("train") or {}).get("stage_seconds") or {}
            if r["seed"] == record["seed"] and r["arm"] == "cartridge" and s.get("synthesize") is not None:
                shared = s
        total = sum((own.get(k) if own.get(k) is not None else shared.get(k)) or 0.0 for k in own)
        return total / 60
    return train["wall_s"] / 60 if not train.get("resumed_from") else None


def seed_mean(records: Sequence[dict]) -> dict:
    """One arm's seeds as one record: each question's gold NLL and correctness averaged over the seeds,
    so that its closure and paired differences carry the seeds' spread into the question-level mean."""
    by_seed = [{q["line"]: q for q in r["questions"]} for r in records]
    lines = set.intersection(*(set(b) for b in by_seed))
    questions = [{**by_seed[0][k], "gold_nll": statistics.mean(float(b[k]["gold_nll"]) for b in by_seed),
                  "correct": statistics.mean(float(b[k]["correct"]) for b in by_seed)} for k in sorted(lines)]
    first = records[0]
    return {**first, "seed": "mean", "seeds": [r["seed"] for r in records], "train": None, "questions": questions,
            "accuracy": statistics.mean(q["correct"] for q in questions),
            "ttft_s": statistics.mean(t) if (t := [r["ttft_s"] for r in records if r["ttft_s"] is not None]) else None}


def variant(record: dict) -> tuple:
    """What makes an arm's row other than its seed: its budget, its name and its conversations."""
    return record["budget"], record["arm"], record["conversations"]


def table_order(key: tuple) -> tuple:
    """Where a variant's rows stand in a table: by budget, then the arms' order, then conversations."""
    budget, arm, conversations = key
    return budget, ARMS.index(arm), conversations


def with_seed_means(records: list[dict]) -> list[dict]:
    """The records, plus a seed-mean record for each variant that ran on more than one seed."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault(variant(r), []).append(r)
    return records + [seed_mean(sorted(g, key=lambda r: r["seed"])) for g in groups.values() if len(g) > 1]


def table(out: Path) -> dict:
    """Per corpus and budget: every arm's accuracy and closure against icl_oracle, and its paired
    difference from BM25 retrieval; then the closure of each arm averaged over the long corpora
    (an arm with several seeds enters as its seed mean)."""
    corpora = {}
    for path in sorted(out.glob("*.jsonl")):
        records = with_seed_means([r for r in read_points(path).values() if r.get("questions")])
        if not records:
            continue
        name = records[0]["corpus"]
        ref = {r["arm"]: r for r in records if r["budget"] == 0}
        bare, ceiling = ref.get("bare"), ref.get("icl_oracle")
        rag_at = {r["budget"]: r for r in records if r["arm"] == "rag"}
        rows = []
        seeds = Counter(variant(r) for r in records if r["seed"] != "mean")
        at = {(*variant(r), r["seed"]): r for r in records}
        for r in sorted(records, key=lambda r: (*table_order(variant(r)), str(r["seed"]))):
            row = {"budget": r["budget"], "arm": r["arm"], "seed": r["seed"], "conversations": r["conversations"],
                   "seeds_of_arm": seeds[variant(r)],
                   "accuracy": r["accuracy"], "accuracy_ci": accuracy_ci(r), "kv_rows": r["kv_rows"],
                   "kv_mib": r["kv_bytes"] / 2**20, "ttft_s": r["ttft_s"], "train_min": minutes(r, records)}
            if bare and ceiling:
                row["closure"] = closure_of(r, bare, ceiling)
                if r["budget"] in rag_at and r["budget"] and r["arm"] != "rag":
                    row["vs_rag"] = paired(r, rag_at[r["budget"]], bare, ceiling)
                if r["arm"] == "fleet_rag" and r["budget"] // 2 in rag_at:  # its chunks alone: the cartridge half's share
                    row["vs_rag_half"] = paired(r, rag_at[r["budget"] // 2], bare, ceiling)
                base = at.get((r["budget"], r["arm"], CONVERSATIONS, r["seed"]))
                if r["conversations"] not in (0, CONVERSATIONS) and base:  # more (or fewer) conversations, same seed
                    row["vs_base_conversations"] = paired(r, base, bare, ceiling)
            rows.append(row)
        corpora[name] = {"questions": len(records[0]["questions"]), "rows": rows}
    return {"corpora": corpora, "mean": _means(corpora)}


def _means(corpora: dict) -> list[dict]:
    """Each (budget, arm)'s closure and accuracy averaged over the corpora that have it."""
    cells: dict[tuple, list] = {}
    for name, c in corpora.items():
        if name.startswith("eval"):
            continue
        for row in c["rows"]:
            if row["seeds_of_arm"] == 1 or row["seed"] == "mean":
                cells.setdefault(variant(row), []).append(row)
    out = []
    for (budget, arm, conversations), rows in sorted(cells.items(), key=lambda kv: table_order(kv[0])):
        closures = [r["closure"]["value"] for r in rows if (r.get("closure") or {}).get("value") is not None]
        out.append({"budget": budget, "arm": arm, "conversations": conversations,
                    "seeds_of_arm": 1, "corpora": len(rows),  # one row per variant: its label names no seed
                    "closure": statistics.mean(closures) if closures else None,
                    "accuracy": statistics.mean(r["accuracy"] for r in rows),
                    "vs_rag": (statistics.mean(r["vs_rag"]["closure"] for r in rows)
                               if all((r.get("vs_rag") or {}).get("closure") is not None for r in rows) else None)})
    return out


def _f(value, fmt: str = "{:.2f}") -> str:
    return "n/a" if value is None else fmt.format(value)


def _ci(ci, fmt: str = "{:.2f}") -> str:
    return "" if not ci else f" ({fmt.format(ci[0])} to {fmt.format(ci[1])})"


def arm_label(row: dict, code: bool = False) -> str:
    """The arm's name, with its conversations where they are not the table's usual count, and its
    seed where the arm ran on several."""
    name = f"`{row['arm']}`" if code else row["arm"]
    if row["conversations"] not in (0, CONVERSATIONS):
        name += f", {row['conversations']:,} conversations"
    if row["seeds_of_arm"] == 1:
        return name
    return f"{name}, mean of {row['seeds_of_arm']} seeds" if row["seed"] == "mean" else f"{name}, seed {row['seed']}"


def markdown(result: dict) -> str:
    lines = []
    for name, c in result["corpora"].items():
        lines += [f"### {name} ({c['questions']} questions)", "",
                  "| budget | arm | accuracy | gold-NLL closure vs `icl_oracle` | vs `rag`, closure (paired) | "
                  "vs `rag`, accuracy (paired) | KV rows | KV MiB | TTFT s | train min |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in c["rows"]:
            cl, vs = r.get("closure") or {}, r.get("vs_rag") or {}
            lines.append(
                f"| {r['budget'] or 'n/a'} | {arm_label(r)} | {100 * r['accuracy']:.1f}%{_ci([100 * x for x in r['accuracy_ci']], '{:.0f}')} "
                f"| {_f(cl.get('value'))}{_ci(cl.get('ci'))} | {_f(vs.get('closure'), '{:+.3f}')}{_ci(vs.get('closure_ci'), '{:+.3f}')} "
                f"| {_f(vs.get('accuracy') and 100 * vs['accuracy'], '{:+.1f}')}{_ci(vs.get('accuracy_ci') and [100 * x for x in vs['accuracy_ci']], '{:+.1f}')} "
                f"| {r['kv_rows']:.0f} | {r['kv_mib']:.1f} | {_f(r['ttft_s'], '{:.2f}')} | {_f(r['train_min'], '{:.1f}')} |")
        lines.append("")
        for r in c["rows"]:
            against = {"vs_rag_half": f"`rag` at {r['budget'] // 2} (its chunks alone)",
                       "vs_base_conversations": f"the same arm and seed on {CONVERSATIONS} conversations"}
            for key, what in against.items():
                h = r.get(key) or {}
                if h.get("closure") is not None:
                    lines += [f"{arm_label(r, code=True)} at {r['budget']} against {what}, paired: "
                              f"closure {h['closure']:+.3f}{_ci(h['closure_ci'], '{:+.3f}')}, accuracy "
                              f"{100 * h['accuracy']:+.1f}{_ci([100 * x for x in h['accuracy_ci']], '{:+.1f}')} points.", ""]
    lines += ["### Mean over the long corpora", "", "| budget | arm | corpora | closure | accuracy | vs `rag`, closure |",
              "|---|---|---|---|---|---|"]
    for m in result["mean"]:
        lines.append(f"| {m['budget'] or 'n/a'} | {arm_label(m)} | {m['corpora']} | {_f(m['closure'])} | "
                     f"{100 * m['accuracy']:.1f}% | {_f(m['vs_rag'], '{:+.3f}')} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="score every point not yet recorded")
    r.add_argument("--corpora", nargs="+", default=list(CORPORA),
                   help="long corpora (docs/eval/long/NAME) or eval:NAME for a docs/eval/ document")
    r.add_argument("--budgets", type=int, nargs="+", default=[512, 2048])
    r.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    r.add_argument("--seeds", type=int, nargs="+", default=[7])
    r.add_argument("--conversations", type=int, default=CONVERSATIONS,
                   help="self-study conversations of a trained arm (a fleet's, over all its documents)")
    r.add_argument("--dtype", default="auto", help="training dtype (scoring is float32)")
    r.add_argument("--store", default=DEFAULT_STORE)
    t = sub.add_parser("table", help="the table from the recorded points")
    t.add_argument("--markdown", action="store_true")
    for p in (r, t):
        p.add_argument("--out", default=DEFAULT_OUT)
        p.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.command == "run":
        unknown = [c for c in args.corpora if not c.startswith("eval:") and not (LONG_DIR / c).is_dir()]
        if unknown:
            raise SystemExit(f"long: unknown corpora {', '.join(unknown)} (in {LONG_DIR}: {', '.join(CORPORA)})")
        result = run(args.corpora, args.budgets, args.arms, args.seeds, args.conversations, out,
                     Path(args.store), args.dtype)
    else:
        result = table(out)
        print(markdown(result) if args.markdown else json.dumps(result["mean"], indent=1))
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
