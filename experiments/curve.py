"""The quality curve: ICL-gap closure against the number of self-study conversations.

QUALITY.md's rows are single budgets; whether more self-study helps on this model is a
question of slope, which takes a grid of (conversations, seed, document) points, each a
train plus an eval. At real budgets a point takes an hour or more, so the driver is
resumable: every finished point is one line of a JSONL file (appended and fsynced), a
rerun skips the points already there, and `cartridges train` itself resumes from the
point's store (finished synthesis shards and checkpoints are kept). Points run in
order of increasing conversations, so the cheap end of the curve lands first.

    python -m experiments.curve run [--docs raft photosynthesis panama] [--seeds 7 8]
        [--conversations 250 500 1000 2000 | --minutes 30] [--dtype bfloat16] [--out docs/quality/curve.jsonl]
        [--store artifacts/curve] [--extra-train-args "--p 512"] [--extra-eval-args "--max-new 16"]
        [--run-args "--task-runner dask --save-every 200"] [--reuse-default-store] [--json]
    python -m experiments.curve plot [--out docs/quality/curve.jsonl docs/quality/levers.jsonl] [--png docs/quality/curve.png]
        [--train-args "--focus --lr 2e-2"] [--minutes 30] [--dtype auto] [--markdown] [--json]
    python -m experiments.curve compare --doc raft [photosynthesis ...] --seed 7 [8] --conversations 250 [--base ""]
        --other "--lr 2e-2" [--other-conversations 125] [--json]
    python -m experiments.curve compare --doc raft panama --seed 7 8 --minutes 30 --base "--p 256"
        --other "--p 256" --dtype float32 --other-dtype auto [--other-out NEWER.jsonl] [--json]
    python -m experiments.curve regions [--out ...] [--train-args ""] [--docs raft] [--minutes 30] [--dtype float32]
        [--json]
    python -m experiments.curve peers [--out ...] [--eval-store artifacts/curve/eval-store] [--minutes 30]
        [--train-args ""] [--docs raft] [--dtype auto] [--json]

`peers` pairs the points with the untrained compression peers (first rows, SnapKV, key norm)
at the cartridge's rows, read from an eval in `--eval-store` that scored them on each document.

`--minutes M` points are sized by a time budget instead (`cartridges train --minutes M`, the
default preset's kind): each runs in a fresh store, pays for its own pilot as a first run on a
machine does, and is keyed by its minutes; its record gives the conversations the budget chose.
They are a measurement of their own, apart from the curve: `plot --minutes M` shows them.
A training lever on such a point (`--reuse-store-of "--p 256"` with `--minutes M`) trains its
twin's conversations on a copy of the twin's store instead: same data, and, for a lever that
leaves the cost alone, the same time; `compare --minutes M` pairs the two.
`--dtype` selects the points trained in one dtype; a selection that holds one point in two
dtypes is refused, since a mean would count it twice.

`plot` draws both closures (accuracy and gold-option NLL) against conversations, the
mean over (document, seed) points with its 95% bootstrap interval, and fits the mean
NLL closure linearly in log10(conversations) to say where it would reach 0.5.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

REPO = Path(__file__).resolve().parents[1]
EVAL_DIR = REPO / "docs" / "eval"
DEFAULT_OUT = "docs/quality/curve.jsonl"
DEFAULT_PNG = "docs/quality/curve.png"
DEFAULT_STORE = "artifacts/curve"
TARGET = 0.5  # the NLL closure the quality note asks about
ARMS = ("bare", "icl", "cartridge")
ARM_FIELDS = ("accuracy", "accuracy_ci", "gold_nll", "gold_nll_ci", "accuracy_gen")
CLOSURES = ("icl_gap_closure", "icl_gap_closure_nll")
TRAIN_FIELDS = ("health", "health_reason", "heldout_loss_before", "heldout_loss_after", "heldout_conversations",
                "steps", "p", "lr", "supervised_tokens", "train_seconds", "synth_seconds", "s_per_conversation",
                "a_ok_rate", "b_degenerate_rate", "coverage_min", "coverage_mean", "fact_coverage", "seconds",
                "run_id", "skipped")  # skipped: stages reused from the store (a resumed point's wall time is partial)
VERSION = 1

# argv -> (exit status, stdout). Injected in tests so no model runs.
Runner = Callable[[list[str]], tuple[int, str]]


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


_QUIET = re.compile(r"^step\s+\d+\s+loss ")  # train's per-step lines: thousands at large budgets


def run_command(argv: list[str]) -> tuple[int, str]:
    """Run a CLI subprocess from the repository root; its stderr (progress bars) passes through,
    its stdout is kept for the JSON line and relayed to stderr except per-step loss lines."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    lines = []
    with subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, bufsize=1) as proc:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                lines.append(line)
                if not line.startswith("{") and not _QUIET.match(line):
                    sys.stderr.write("  | " + line)
                    sys.stderr.flush()
        except BaseException:  # killed or interrupted: stop the child too, or it trains on unowned
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    return proc.returncode, "".join(lines)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_command, which stops the child


def last_json(stdout: str) -> dict:
    """The last stdout line as a JSON object (the CLI's --json contract)."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise ValueError("no output")
    obj = json.loads(lines[-1])
    if not isinstance(obj, dict):
        raise ValueError("last line is not a JSON object")
    return obj


def doc_path(doc: str) -> Path:
    """A document name of the eval set (raft) or a path to a document."""
    path = Path(doc)
    if path.suffix or os.sep in doc:
        return path.resolve()
    return EVAL_DIR / f"{doc}.md"


def doc_name(doc: str) -> str:
    return Path(doc).stem


def size_key(minutes: float | None, n: int) -> int | str:
    """A point's budget: its planned conversations, or its minutes for a time-budgeted point."""
    return f"{minutes:g} min" if minutes else n


def size_label(minutes: float | None, n: int | None) -> str:
    """A point's budget as messages name it: "30 min", or "n 250"."""
    return f"{minutes:g} min" if minutes else f"n {n}"


def point_key(record: dict) -> tuple:
    """What makes two points the same measurement."""
    return (record["doc"], int(record["seed"]), size_key(record.get("minutes"), int(record["conversations_planned"])),
            record["dtype"], record.get("eval_dtype"), tuple(record.get("extra_train_args") or ()),
            tuple(record.get("extra_eval_args") or ()))


def read_records(path: Path) -> list[dict]:
    """Finished points; a damaged line (a write cut by a kill) is reported and ignored."""
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            log(f"curve: {path}:{number}: not JSON (a cut write?), ignored")
            continue
        if isinstance(record, dict) and record.get("status") == "done":
            records.append(record)
    return records


def read_all(paths: Sequence[Path]) -> list[dict]:
    """Finished points of several results files (a curve beside its levers); where two hold the same
    measurement, the later one counts."""
    by_key = {point_key(r): r for path in paths for r in read_records(path)}
    return list(by_key.values())


def append_record(path: Path, record: dict) -> None:
    """One line, flushed and fsynced: a kill loses at most the point in progress."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as fh:
        if fh.tell() > 0:
            with open(path, "rb") as check:
                check.seek(-1, os.SEEK_END)
                if check.read(1) != b"\n":
                    fh.write(b"\n")  # end a line cut by an earlier kill so this one parses
        fh.write((json.dumps(record, sort_keys=True) + "\n").encode())
        fh.flush()
        os.fsync(fh.fileno())


def point_dir(store: Path, doc: str, seed: int, n: int, dtype: str, extra: Sequence[str],
              minutes: float | None = None) -> Path:
    """<store>/<doc>-s<S>-n<N> (-m<M> for a time budget), with a tag when the dtype or extra
    arguments differ from the defaults, so another configuration does not overwrite the default
    point's cartridge."""
    name = f"{doc}-s{seed}-" + (f"m{minutes:g}" if minutes else f"n{n}")
    if dtype != "bfloat16" or extra:
        name += "-" + hashlib.sha256(json.dumps([dtype, list(extra)]).encode()).hexdigest()[:8]
    return store / name


def seed_store(directory: Path, source: Path) -> bool:
    """Start a point from a copy of another point's store. For a lever (the default point's
    store) the stages its extra arguments leave unchanged (ingest through synthesis and the
    teacher) are reused: a training lever then costs training only. For more conversations (a
    smaller point's store) synthesis takes over the smaller point's conversations, the first of
    its own plan. Stages are keyed by their config, so what differs runs again. The source's
    cartridge is left behind; a store already there is kept."""
    if directory.exists() or not (source / "catalog.duckdb").is_file():
        return False
    shutil.copytree(source, directory, ignore=shutil.ignore_patterns("cartridge.safetensors"))
    return True


def smaller_point(store: Path, doc: str, seed: int, n: int, dtype: str, extra: Sequence[str]) -> Path | None:
    """The store of this configuration's largest point below `n` conversations, if one exists."""
    head, tail = f"{doc}-s{seed}-n", point_dir(store, doc, seed, 0, dtype, extra).name.removeprefix(f"{doc}-s{seed}-n0")
    pattern = re.compile(re.escape(head) + r"(\d+)" + re.escape(tail) + "$")
    found = [(int(m.group(1)), d) for d in store.glob(f"{head}*") if (m := pattern.match(d.name))
             and int(m.group(1)) < n and (d / "catalog.duckdb").is_file()]
    return max(found)[1] if found else None


def twin_conversations(store: Path) -> int | None:
    """The conversations a time budget chose for the finished run in `store`; None without one."""
    from storage import Store

    if not (store / "catalog.duckdb").is_file():
        return None
    runs = [r for r in Store(store, read_only=True).catalog.runs()
            if r["flow"] == "cartridge" and r["status"] == "complete" and (r["summary"] or {}).get("budget")]
    return int(runs[-1]["summary"]["budget"]["conversations"]) if runs else None


def train_argv(doc: str, seed: int, n: int, dtype: str, directory: Path, extra: Sequence[str],
               run_args: Sequence[str] = (), minutes: float | None = None) -> list[str]:
    size = ["--minutes", f"{minutes:g}"] if minutes else ["--conversations", str(n)]
    return [sys.executable, "-m", "cli.main", "train", "--corpus", str(doc_path(doc)), *size,
            "--seed", str(seed), "--dtype", dtype, "--store", str(directory),
            "--save", str(directory / "cartridge.safetensors"), *extra, *run_args, "--json"]


def eval_argv(qa: Path, doc: str, cartridge: str, eval_store: Path, dtype: str, peers: bool,
              extra: Sequence[str] = ()) -> list[str]:
    """The eval keeps only the questions whose "doc" is in --corpus, so the shared question file
    needs no filtering; one eval store for all points reuses the bare, ICL and full-KV arms."""
    return [sys.executable, "-m", "cli.main", "eval", "--qa", str(qa), "--cartridge", cartridge,
            "--corpus", str(doc_path(doc)), "--store", str(eval_store), "--dtype", dtype,
            *([] if peers else ["--no-peers"]), *extra, "--json"]


def make_record(doc: str, seed: int, n: int, dtype: str, eval_dtype: str, extra: Sequence[str], train: dict,
                evaluation: dict, train_wall: float, eval_wall: float, directory: Path,
                extra_eval: Sequence[str] = (), minutes: float | None = None) -> dict:
    planned = int((train.get("budget") or {}).get("conversations") or n)  # the budget chose, or the twin's did
    record = {
        "version": VERSION, "status": "done", "doc": doc, "seed": seed, "conversations_planned": planned,
        "conversations_used": train.get("conversations"), "planned_conversations_train": train.get(
            "planned_conversations"), "dtype": dtype, "eval_dtype": eval_dtype, "extra_train_args": list(extra),
        "extra_eval_args": list(extra_eval),
        "train_wall_s": train_wall, "eval_wall_s": eval_wall, "store": str(directory),
        "cartridge": train.get("cartridge"), "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "questions": evaluation.get("questions"),
    }
    if minutes:
        record["minutes"] = minutes
    record["train"] = {k: train[k] for k in TRAIN_FIELDS if k in train}
    before, after = train.get("heldout_loss_before"), train.get("heldout_loss_after")
    record["heldout_change"] = (after - before) / before if before and after is not None else None
    arms = evaluation.get("arms") or {}
    record["arms"] = {arm: {k: arms[arm][k] for k in ARM_FIELDS if k in arms[arm]} for arm in ARMS if arm in arms}
    for name in CLOSURES:
        c = evaluation.get(name) or {}
        record[name] = {k: c.get(k) for k in ("value", "ci", "reason", "ci_left_out")}
    return record


def plan(docs: Iterable[str], seeds: Iterable[int], conversations: Iterable[int]) -> list[tuple[str, int, int]]:
    """(doc, seed, n) in order of increasing n: the cheap points finish first."""
    return [(d, s, n) for n in sorted(set(conversations)) for s in seeds for d in docs]


def run_curve(docs: Sequence[str], seeds: Sequence[int], conversations: Sequence[int], dtype: str, out: Path,
              store: Path, extra: Sequence[str] = (), eval_dtype: str = "float32", qa: Path = EVAL_DIR / "questions.jsonl",
              peers: bool = False, extra_eval: Sequence[str] = (), runner: Runner = run_command,
              reuse_default: bool = False, reuse_of: Sequence[str] = (), run_args: Sequence[str] = (),
              minutes: float | None = None) -> dict:
    """Run every point not yet in `out`; returns what ran, what was skipped and what failed.
    `minutes`: points sized by that time budget instead of `conversations` (one per doc and seed),
    each in a fresh store: a copied store would reuse work and time the budget short.
    `run_args`: train options that change how a point runs, not what it makes (`--task-runner
    dask`, `--save-every N`); they stay out of the point's key and store name.
    `reuse_default`: a point with extra train arguments starts from the store of the point whose
    train arguments are `reuse_of` (the default point's when empty). With `minutes` that twin's
    budget sizes the point: it trains the twin's conversations on the twin's synthesis, so a
    training lever that leaves the cost alone is paired at equal data and equal time."""
    done = {point_key(r) for r in read_records(out)}
    ran, skipped, failed = [], [], []
    points = plan(docs, seeds, [0] if minutes else conversations)
    for i, (doc, seed, n) in enumerate(points, 1):
        name = doc_name(doc)
        key = (name, seed, size_key(minutes, n), dtype, eval_dtype, tuple(extra), tuple(extra_eval))
        label = f"{name} seed {seed} {size_label(minutes, n)}"
        if key in done:
            log(f"curve: [{i}/{len(points)}] {label}: in {out}, skipped")
            skipped.append(label)
            continue
        directory = point_dir(store, name, seed, n, dtype, extra, minutes)
        default = point_dir(store, name, seed, n, dtype, reuse_of, minutes)
        seeded, lever = None, reuse_default and list(extra) != list(reuse_of)
        if minutes and lever:  # a training lever on its twin's synthesis: the twin's budget sized both
            if (n := twin_conversations(default)) is None:
                log(f"curve: {label}: no finished twin in {default} to take the synthesis of; point skipped")
                failed.append({"point": label, "stage": "train", "reason": f"no finished run in {default}"})
                continue
            seed_store(directory, default)  # a resumed lever keeps its own copy
            seeded = default
        elif not minutes:  # a fresh time-budgeted point starts empty: reused work would time its budget short
            if lever and seed_store(directory, default):
                seeded = default
            elif (smaller := smaller_point(store, name, seed, n, dtype, extra)) and seed_store(directory, smaller):
                seeded = smaller
        if seeded:
            log(f"curve: {label}: store copied from {seeded}")
        log(f"curve: [{i}/{len(points)}] {label}: train -> {directory}")
        start = time.perf_counter()
        sized_by = None if minutes and lever else minutes  # a lever trains its twin's conversations
        code, stdout = runner(train_argv(doc, seed, n, dtype, directory, extra, run_args, sized_by))
        train_wall = time.perf_counter() - start
        try:
            train = last_json(stdout)
        except ValueError as exc:
            train = None
            why = f"train exit {code}, no JSON ({exc})"
        if train is not None and code not in (0, 3):  # 3: failed health check, cartridge kept
            train, why = None, f"train exit {code}"
        if train is None:
            log(f"curve: {label}: {why}; point not recorded (rerun to resume)")
            failed.append({"point": label, "stage": "train", "reason": why})
            continue
        if code == 3:
            log(f"curve: {label}: training health check failed ({train.get('health_reason')}); evaluating anyway")
        cartridge = train.get("cartridge") or str(directory / "cartridge.safetensors")
        log(f"curve: {label}: trained in {train_wall / 60:.1f} min; eval")
        start = time.perf_counter()
        code, stdout = runner(eval_argv(qa, doc, cartridge, store / "eval-store", eval_dtype, peers, extra_eval))
        eval_wall = time.perf_counter() - start
        try:
            evaluation = last_json(stdout) if code == 0 else None
        except ValueError:
            evaluation = None
        if evaluation is None:
            log(f"curve: {label}: eval exit {code}; point not recorded (rerun to resume)")
            failed.append({"point": label, "stage": "eval", "reason": f"eval exit {code}"})
            continue
        record = make_record(name, seed, n, dtype, eval_dtype, extra, train, evaluation, train_wall, eval_wall,
                             directory, extra_eval, minutes)
        for field, key in KEPT.items():
            record[key] = per_question(record, store / "eval-store", field)
        if seeded:
            record["store_seeded_from"] = str(seeded)  # its train wall leaves out what the copy held
        append_record(out, record)
        done.add(key)
        ran.append(label)
        log(f"curve: {label}: NLL closure {_num(record['icl_gap_closure_nll']['value'])}, accuracy closure "
            f"{_num(record['icl_gap_closure']['value'])} (train {train_wall / 60:.1f} min, eval {eval_wall / 60:.1f} min)")
    return {"out": str(out), "ran": ran, "skipped": skipped, "failed": failed, "points": len(points)}


# ---- aggregation


def points_ci(values: Sequence[float]) -> tuple[float, float] | None:
    """The eval's 95% interval of the mean (`scoring.bootstrap_ci`), resampling (doc, seed) points
    instead of questions; None for fewer than two points."""
    from cartridges.evaluation.scoring import bootstrap_ci

    return bootstrap_ci(values) if len(values) >= 2 else None


def closure_draws(by_doc: dict[str, list[dict[int, dict[str, float]]]], arms: Sequence[str] = ("cartridge",),
                  field: str = "gold_nll", samples: int = 2000,
                  seed: int = 0) -> tuple[dict[str, float], dict[str, np.ndarray]] | None:
    """Each arm's mean closure on `field` ("gold_nll" or "correct") over the points (per document,
    one per-question answers map for each seed), and that mean on each resample of each document's
    questions: one draw for all of a document's seeds and arms, which answer the same questions,
    so seeds and arms stay paired. NaN where some point's closure is undefined on a resample; None
    where a document has fewer than two questions scored on bare, ICL and every arm."""
    import numpy as np

    from cartridges.evaluation.scoring import resampled_closures

    rng = np.random.default_rng(seed)
    n = sum(len(points) for points in by_doc.values())
    estimate, draws = dict.fromkeys(arms, 0.0), {arm: np.zeros(samples) for arm in arms}
    for points in by_doc.values():
        lines = scored_lines(points, [{"bare", "icl", *arms}] * len(points))
        if len(lines) < 2:
            return None
        draw = rng.integers(0, len(lines), size=(samples, len(lines)))
        # NLL is lower-is-better: negated for the closure's higher-is-better values; accuracy's
        # closure needs ICL ahead by two questions, as the eval's `gap_closure` does
        sign, min_gap = (-1.0, 0.0) if field == "gold_nll" else (1.0, 2 / len(lines))
        for p in points:
            for arm in arms:
                values = [[sign * p[k][a] for k in lines] for a in (arm, "bare", "icl")]
                estimate[arm] += float(resampled_closures(*values, np.arange(len(lines))[None, :], min_gap)[0])
                draws[arm] += resampled_closures(*values, draw, min_gap)
    return {arm: v / n for arm, v in estimate.items()}, {arm: v / n for arm, v in draws.items()}


def percentile_ci(draws: np.ndarray) -> tuple[float, float] | None:
    """The 95% percentile interval of the defined resamples; None when fewer than half are defined."""
    import numpy as np

    kept = draws[~np.isnan(draws)]
    if kept.size < draws.size / 2:
        return None
    return float(np.percentile(kept, 2.5)), float(np.percentile(kept, 97.5))


def by_document(group: Sequence[dict], field: str = "gold_nll") -> dict[str, list[dict[int, dict[str, float]]]] | None:
    """The group's kept per-question values, per document (one map per seed); None unless every
    point kept them."""
    out: dict[str, list[dict[int, dict[str, float]]]] = {}
    for r in group:
        if (answers := kept_answers(r, field)) is None:
            return None
        out.setdefault(r["doc"], []).append(answers)
    return out


def questions_ci(group: Sequence[dict], field: str = "gold_nll", samples: int = 2000,
                 seed: int = 0) -> tuple[float, float] | None:
    """The 95% interval of the mean closure on `field` over `group`'s points, resampling each
    document's questions (`closure_draws`): the documents and seeds are the design, the questions
    the sample, so a handful of points still gets an interval as wide as its questions leave it.
    None unless every point kept its per-question values, or when most resamples leave some
    point's closure undefined."""
    if (by_doc := by_document(group, field)) is None:
        return None
    if (result := closure_draws(by_doc, ("cartridge",), field, samples, seed)) is None:
        return None
    return percentile_ci(result[1]["cartridge"])


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _closure(record: dict, name: str) -> float | None:
    value = (record.get(name) or {}).get("value")
    return float(value) if value is not None else None


def _acc(record: dict, arm: str) -> float | None:
    return (record.get("arms") or {}).get(arm, {}).get("accuracy")


def aggregate(records: Sequence[dict]) -> list[dict]:
    """One row per budget (planned conversations, or minutes): means over (doc, seed) points and
    their intervals (for NLL closure, over questions where every point kept them, else over points).
    Undefined closures (ICL not ahead of bare) are left out of a mean and counted."""
    groups: dict[int | str, list[dict]] = {}
    for r in records:
        groups.setdefault(size_key(r.get("minutes"), int(r["conversations_planned"])), []).append(r)
    rows = []
    for group in sorted(groups.values(), key=lambda g: _mean([int(r["conversations_planned"]) for r in g])):
        n = round(_mean([int(r["conversations_planned"]) for r in group]))  # a time budget's sizes differ
        row: dict = {"conversations": n, "points": len(group),
                     "health_failed": sum(1 for r in group if (r.get("train") or {}).get("health") == "failed")}
        for name, short, field in (("icl_gap_closure_nll", "nll_closure", "gold_nll"),
                                   ("icl_gap_closure", "acc_closure", "correct")):
            vals = [v for v in (_closure(r, name) for r in group) if v is not None]
            row[short] = _mean(vals)
            by_questions = questions_ci(group, field)
            row[f"{short}_ci"] = by_questions or points_ci(vals)
            row[f"{short}_ci_over"] = "questions" if by_questions else "points"
            row[f"{short}_points"] = len(vals)
        for arm in ARMS:
            row[f"{arm}_accuracy"] = _mean([v for v in (_acc(r, arm) for r in group) if v is not None])
        # bare and in context score the same on every seed of a document; only the cartridge varies
        row["cartridge_accuracy_ci"] = points_ci([v for v in (_acc(r, "cartridge") for r in group)
                                                  if v is not None])
        row["train_wall_min"] = _mean([r["train_wall_s"] / 60 for r in group if r.get("train_wall_s") is not None])
        used = [r["conversations_used"] for r in group if r.get("conversations_used") is not None]
        row["conversations_used"] = _mean(used)
        if group[0].get("minutes"):
            row["minutes"] = group[0]["minutes"]
        rows.append(row)
    return rows


def per_doc(records: Sequence[dict], name: str) -> dict[str, list[tuple[int, float]]]:
    """Per document: (n, mean closure over seeds), for the thin lines."""
    out: dict[str, list[tuple[int, float]]] = {}
    for doc in sorted({r["doc"] for r in records}):
        for n in sorted({int(r["conversations_planned"]) for r in records if r["doc"] == doc}):
            vals = [v for v in (_closure(r, name) for r in records
                                if r["doc"] == doc and int(r["conversations_planned"]) == n) if v is not None]
            if vals:
                out.setdefault(doc, []).append((n, sum(vals) / len(vals)))
    return out


def fit(rows: Sequence[dict], key: str = "nll_closure", target: float = TARGET) -> dict:
    """Least squares of the per-n mean closure on log10(n), and the n where the line reaches
    `target` (an extrapolation when beyond the grid; None when the slope is not positive)."""
    pts = [(math.log10(r["conversations"]), r[key]) for r in rows if r.get(key) is not None]
    out: dict = {"metric": key, "target": target, "points": len(pts), "slope_per_decade": None,
                 "intercept": None, "n_at_target": None, "reason": None}
    if len(pts) < 2 or len({x for x, _ in pts}) < 2:
        out["reason"] = "needs means at two or more conversation counts"
        return out
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    intercept = my - slope * mx
    out.update(slope_per_decade=slope, intercept=intercept)
    if slope <= 0:
        out["reason"] = "the closure does not rise with conversations"
    else:
        out["n_at_target"] = 10 ** ((target - intercept) / slope)
        out["extrapolated"] = out["n_at_target"] > max(r["conversations"] for r in rows)
    return out


# ---- paired comparison of two configurations on the same questions


SCORED = frozenset({"bare", "cartridge", "icl"})


def scored_lines(points: Sequence[dict[int, dict[str, float]]], arms: Sequence[Collection[str]]) -> list[int]:
    """The question lines on which each point scored its arms (`points[i]` needs `arms[i]`)."""
    return sorted(set.intersection(*({k for k, got in p.items() if set(need) <= got.keys()}
                                     for p, need in zip(points, arms, strict=True))))


KEPT = {"gold_nll": "gold_nll_by_line", "correct": "correct_by_line"}  # answers field -> record key


def kept_answers(record: dict, field: str = "gold_nll") -> dict[int, dict[str, float]] | None:
    """The per-question values of `field` the record kept itself, or None for a record that kept none."""
    kept = record.get(KEPT[field])
    return {int(line): {arm: float(v) for arm, v in arms.items()} for line, arms in kept.items()} if kept else None


def eval_answers(record: dict, eval_store: Path, field: str = "gold_nll") -> dict[int, dict[str, float]]:
    """Per question line: each arm's `field` (the gold option's NLL, or 1.0 / 0.0 for a correct
    choice). A record keeps them itself (`KEPT`), so a committed results file pairs without its
    stores; older records fall back to the eval that scored this point's cartridge."""
    if (kept := kept_answers(record, field)) is not None:
        return kept
    for result in sorted(eval_store.glob("eval/*/result.json")):
        if json.loads(result.read_text()).get("cartridges") == [record["cartridge"]]:
            return read_answers(result.parent / "answers.jsonl", field)
    raise SystemExit(f"curve: no eval in {eval_store} scored {record['cartridge']}")


def read_answers(path: Path, field: str = "gold_nll", arms: Collection[str] | None = None,
                 doc: str | None = None) -> dict[int, dict[str, float]]:
    """An eval's answers.jsonl as line -> arm -> `field`, for `arms` (None: all) on `doc`'s
    questions (None: all)."""
    out: dict[int, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get(field) is not None and (arms is None or row["arm"] in arms) and (doc is None or row.get("doc") == doc):
            out.setdefault(int(row["line"]), {})[row["arm"]] = float(row[field])
    return out


def peer_answers(eval_store: Path, doc: str, rows: int) -> dict[int, dict[str, float]]:
    """Per question line of `doc`: each compression peer's gold NLL at `rows` rows, from the newest
    eval in `eval_store` that scored the peers on it at that size. Peers are untrained, so one
    eval serves every seed."""
    from cartridges.evaluation.arms import PEERS

    name = doc_path(doc).name
    for result in sorted(eval_store.glob("eval/*/result.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        arms = json.loads(result.read_text()).get("arms") or {}
        prompt = (arms.get("bare") or {}).get("kv_rows", 0)  # an arm's rows include the question's own
        if all(round((arms.get(peer) or {}).get("kv_rows", -1) - prompt) == rows for peer in PEERS):
            if found := read_answers(result.parent / "answers.jsonl", arms=PEERS, doc=name):
                return found
    raise SystemExit(f"curve: no eval in {eval_store} scored the compression peers on {name} at {rows} rows; "
                     f"run `python -m cli.main eval` there with a {rows}-row cartridge and --corpus {doc_path(doc)}")


def versus_peers(records: Sequence[dict], eval_store: Path, samples: int = 2000, seed: int = 0) -> dict:
    """The points' mean gold-NLL closure beside each compression peer's at the same rows, and the
    cartridge's lead over each, paired: every resample draws one set of each document's questions
    for its seeds and all arms."""
    from cartridges.evaluation.arms import PEERS

    rows = {int((r.get("train") or {}).get("p") or 0) for r in records}
    if len(rows) != 1 or 0 in rows:
        raise SystemExit(f"curve: the points need one known cartridge size to meet peers at, got {sorted(rows)}")
    p = rows.pop()
    by_doc = by_document(records)
    if by_doc is None:
        raise SystemExit("curve: a point kept no per-question NLLs; it cannot be paired with the peers")
    for doc, points in by_doc.items():
        peers = peer_answers(eval_store, doc, p)
        for answers in points:
            for line, arms in peers.items():
                answers.setdefault(line, {}).update(arms)
    if (result := closure_draws(by_doc, ("cartridge", *PEERS), samples=samples, seed=seed)) is None:
        raise SystemExit("curve: fewer than two questions scored on every arm of some document")
    estimate, draws = result
    if any(math.isnan(v) for v in estimate.values()):
        raise SystemExit("curve: some point's NLL closure is undefined (in context not ahead of bare); "
                         "leave its document out with --docs")
    peers_out = [{"arm": arm, "closure": estimate[arm], "closure_ci": percentile_ci(draws[arm]),
                  "lead": estimate["cartridge"] - estimate[arm],
                  "lead_ci": percentile_ci(draws["cartridge"] - draws[arm])} for arm in PEERS]
    best = max(peers_out, key=lambda r: r["closure"])
    return {"points": len(records), "rows": p, "documents": sorted(by_doc),
            "cartridge": {"closure": estimate["cartridge"], "closure_ci": percentile_ci(draws["cartridge"])},
            "peers": peers_out, "best_peer": best["arm"]}


def per_question(record: dict, eval_store: Path, field: str = "gold_nll") -> dict[str, dict[str, float]] | None:
    """What a record keeps of its eval's answers (JSON keys are strings); None when the eval left none."""
    try:
        answers = eval_answers(record, eval_store, field)
    except SystemExit as exc:
        log(f"{exc}; the record keeps no per-question {field}")
        return None
    return {str(line): arms for line, arms in sorted(answers.items())}


Changes = tuple[list[int], "np.ndarray", float]


def with_cartridge(kept: dict[int, dict[str, float]], gold: dict[int, float]) -> dict[int, dict[str, float]]:
    """A point from a record's kept answers (bare, ICL) and another cartridge's gold NLL by
    question line, over the lines both have: what the studies that retrain on a point's
    synthesis score and pair."""
    return {line: {**kept[line], "cartridge": gold[line]} for line in kept if line in gold}


def point_closure(point: dict[int, dict[str, float]]) -> float:
    """The cartridge's gold-NLL closure over a point's questions: its share of the summed
    bare-to-ICL gap."""
    return sum(v["bare"] - v["cartridge"] for v in point.values()) / sum(v["bare"] - v["icl"] for v in point.values())


def question_changes(a: dict[int, dict[str, float]], b: dict[int, dict[str, float]]) -> Changes:
    """The questions both points scored, the cartridge's gold-NLL change on each from a to b, and
    a's mean bare-to-ICL gap over them."""
    import numpy as np

    lines = scored_lines([a, b], [SCORED, {"cartridge"}])
    if len(lines) < 2:
        raise SystemExit("curve: fewer than two questions scored by both points")
    diff = np.array([b[k]["cartridge"] - a[k]["cartridge"] for k in lines])
    return lines, diff, float(np.mean([a[k]["bare"] - a[k]["icl"] for k in lines]))


def pooled(changes: Sequence[Changes], samples: int = 2000, seed: int = 0,
           groups: Sequence[Hashable] | None = None) -> dict:
    """Closure change over several points: each point's mean change in its own closure units
    (its own bare-to-ICL gap), averaged with equal weight. The 95% interval resamples questions
    within each group (a document), one draw for all of a group's points (its seeds, which answer
    the same questions), so seeds stay paired and a document with more questions does not
    outweigh the others. `groups` names each point's group (None: a group each). None where a
    point's gap is not positive (it has no closure units)."""
    import numpy as np

    groups = list(range(len(changes))) if groups is None else list(groups)
    members: dict = {}
    for change, group in zip(changes, groups, strict=True):
        members.setdefault(group, []).append(change)
    rng = np.random.default_rng(seed)
    means, total, n = np.zeros(samples), 0.0, len(changes)
    out = {"documents": len(members), "points": n}
    for group_changes in members.values():
        common = sorted(set.intersection(*(set(lines) for lines, _, _ in group_changes)))
        draw = rng.integers(0, len(common), size=(samples, len(common)))
        for lines, diff, gap in group_changes:
            if gap <= 0:
                return {**out, "closure_change": None, "closure_change_ci": None}
            at = {line: i for i, line in enumerate(lines)}
            change = -diff[[at[line] for line in common]] / gap
            total += float(change.mean())
            means += change[draw].mean(axis=1)
    return {**out, "closure_change": total / n,
            "closure_change_ci": [float(np.percentile(means / n, 2.5)), float(np.percentile(means / n, 97.5))]}


def paired(changes: Changes, samples: int = 2000, seed: int = 0) -> dict:
    """Mean change of the cartridge's gold NLL from base to other over the questions both scored, with a
    95% bootstrap interval over questions, and the same in closure units (per unit of the mean
    bare-to-ICL gap): the two cartridges answer the same questions, so their difference is far
    less noisy than two closures with their own intervals."""
    from cartridges.evaluation.scoring import bootstrap_ci

    lines, diff, gap = changes
    lo, hi = bootstrap_ci(diff, samples, seed)
    out = {"questions": len(lines), "gold_nll_change": float(diff.mean()), "gold_nll_change_ci": [lo, hi],
           "gap": gap, "better": int((diff < 0).sum()), "worse": int((diff > 0).sum())}
    if gap > 0:
        out["closure_change"] = -float(diff.mean()) / gap
        out["closure_change_ci"] = [-hi / gap, -lo / gap]
    return out


def compare(outs: Sequence[Path], doc: str, seed: int, n: int | None, base: Sequence[str], other: Sequence[str],
            other_n: int | None = None, dtype: str | None = None, other_dtype: str | None = None,
            minutes: float | None = None, other_outs: Sequence[Path] | None = None) -> dict:
    """`other` against `base` for one (doc, seed) in the results files, both at `n` conversations or
    `other` at `other_n` (a comparison at equal compute of configurations that differ in cost), or
    both sized by the time budget `minutes` (equal compute by construction). `dtype` (and
    `other_dtype`, default `dtype`) picks the training dtype where a point was trained in more
    than one, or pairs twins trained in two. `other_outs` reads `other` from other results files:
    the same configuration before and after a change the key does not see (the code, the runner)."""
    return compare_docs(outs, [doc], [seed], n, base, other, other_n, dtype, other_dtype, minutes,
                        other_outs)["per_doc"][0]


def compare_docs(outs: Sequence[Path], docs: Sequence[str], seeds: Sequence[int], n: int | None,
                 base: Sequence[str], other: Sequence[str], other_n: int | None = None, dtype: str | None = None,
                 other_dtype: str | None = None, minutes: float | None = None,
                 other_outs: Sequence[Path] | None = None) -> dict:
    """`compare` on each (document, seed), and, given several, the closure change over all of them
    (`pooled`, a document's seeds sharing its question draws)."""
    if (n is None) == (minutes is None):
        raise SystemExit("curve: size the points by conversations or by minutes, one of the two")
    if minutes is not None and other_n is not None:
        raise SystemExit("curve: --other-conversations pairs points sized by conversations; time-budgeted "
                         "twins share their minutes")
    other_n = n if other_n is None else other_n
    other_dtype = dtype if other_dtype is None else other_dtype
    other_outs = outs if other_outs is None else other_outs
    sides = (("base", base, n, dtype, outs, read_all(outs)),
             ("other", other, other_n, other_dtype, other_outs, read_all(other_outs)))
    cells = [(doc, seed) for doc in docs for seed in seeds]
    points = [{name: _point(records, files, doc, seed, budget, args, want, minutes)
               for name, args, budget, want, files, records in sides}
              for doc, seed in cells]
    changes = [question_changes(*(eval_answers(p[k], Path(p[k]["store"]).parent / "eval-store")
                                  for k in ("base", "other"))) for p in points]
    per_doc = [{"doc": doc, "seed": seed, "conversations": n, "other_conversations": other_n, "minutes": minutes,
                "base": list(base), "other": list(other), "dtype": p["base"]["dtype"],
                "other_dtype": p["other"]["dtype"], **paired(c)}
               for (doc, seed), p, c in zip(cells, points, changes, strict=True)]
    if len(cells) < 2:
        return {"per_doc": per_doc}
    return {"per_doc": per_doc, **pooled(changes, groups=[doc for doc, _ in cells])}


def _point(records: list[dict], outs: Sequence[Path], doc: str, seed: int, n: int | None, args: Sequence[str],
           dtype: str | None, minutes: float | None = None) -> dict:
    """The point's newest record. A point trained in several dtypes is ambiguous without `dtype`:
    their cartridges differ, so taking the newest would pair whichever ran last."""
    match = [r for r in select(records, args, minutes=minutes, dtype=dtype) if r["doc"] == doc
             and int(r["seed"]) == seed and (minutes is not None or int(r["conversations_planned"]) == n)]
    where = f"{doc} seed {seed} {size_label(minutes, n)} with train args {shlex.join(args)!r}"
    if not match:
        trained = f" trained in {dtype}" if dtype else ""
        raise SystemExit(f"curve: no point {where}{trained} in " + ", ".join(map(str, outs)))
    one_dtype_each(match, "with --dtype (and --other-dtype)")
    return match[-1]


# ---- where in the document the closure is


def opening_regions(text: str, tokenizer, p: int) -> set[str]:
    """Headings of the sections that begin inside a document's first `p` context tokens: what a
    first-p (corpus) init holds exactly before any training."""
    from cartridges.core.chat import system_ids

    opening = tokenizer.decode(system_ids(tokenizer, text)[:p])
    return {line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#") and line in opening}


def closure_by_region(record: dict, opening: set[str], questions: Sequence[str]) -> dict[str, dict]:
    """A point's gold-NLL closure on the questions about the opening (the first p tokens) and on the
    rest, each as the mean NLL drop over the mean bare-to-ICL gap of its questions (`questions`: the
    question file's lines)."""
    answers = eval_answers(record, Path(record["store"]).parent / "eval-store")
    groups: dict[str, list[dict[str, float]]] = {"opening": [], "rest": []}
    for line, arms in answers.items():
        region = json.loads(questions[line - 1]).get("region")
        if {"bare", "icl", "cartridge"} <= arms.keys():
            groups["opening" if region in opening else "rest"].append(arms)
    out = {}
    for name, rows in groups.items():
        gap = sum(a["bare"] - a["icl"] for a in rows)
        out[name] = {"questions": len(rows),
                     "closure": sum(a["bare"] - a["cartridge"] for a in rows) / gap if rows and gap > 0 else None}
    return out


def regions(outs: Sequence[Path], train_args: Sequence[str] | None, docs: Sequence[str] | None, qa: Path,
            dtype: str | None = None, minutes: float | None = None) -> list[dict]:
    """`closure_by_region` for every selected point (`selected`: an empty selection is an error, as
    is a point trained in two dtypes). Points that kept no per-question NLLs are skipped."""
    from cartridges.core.models import load_model

    tokenizer = load_model("smollm2").tokenizer
    questions = qa.read_text().splitlines()
    cache: dict[tuple[str, int], set[str]] = {}
    rows = []
    for r in selected(outs, train_args, docs, minutes, dtype):
        p = int(r.get("train", {}).get("p") or 0)
        if not p or not r.get("gold_nll_by_line"):
            continue
        if (r["doc"], p) not in cache:
            cache[r["doc"], p] = opening_regions(doc_path(r["doc"]).read_text(), tokenizer, p)
        opening = cache[r["doc"], p]
        rows.append({"doc": r["doc"], "seed": r["seed"], "conversations": r["conversations_planned"], "p": p,
                     "train_args": r["extra_train_args"], "dtype": r.get("dtype"),
                     **closure_by_region(r, opening, questions)})
    return rows


# ---- output


def _num(value: float | None, fmt: str = "{:.2f}") -> str:
    return "n/a" if value is None else fmt.format(value)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _ci(ci: Sequence[float] | None) -> str:
    return "" if not ci else f" ({ci[0]:.2f} to {ci[1]:.2f})"


def _pct_ci(ci: Sequence[float] | None) -> str:
    return "" if not ci else f" ({100 * ci[0]:.1f} to {100 * ci[1]:.1f}%)"


def fit_line(f: dict) -> str:
    if f["n_at_target"] is None:
        return f"fit: mean NLL closure vs log10(conversations): {f['reason']}" + (
            f" (slope {f['slope_per_decade']:+.3f} per decade)" if f["slope_per_decade"] is not None else "")
    where = "extrapolated" if f.get("extrapolated") else "within the grid"
    return (f"fit: mean NLL closure = {f['intercept']:+.3f} {f['slope_per_decade']:+.3f} * log10(conversations); "
            f"reaches {f['target']} at about {f['n_at_target']:,.0f} conversations ({where}, {f['points']} means)")


def _over(row: dict, short: str) -> str:
    """The mark of an interval that resampled points instead of questions."""
    return "*" if row[f"{short}_ci_over"] == "points" and row[f"{short}_ci"] else ""


def markdown(records: Sequence[dict], rows: Sequence[dict], f: dict) -> str:
    lines = ["| conversations (used) | points | NLL closure (95% CI) | accuracy closure (95% CI) | bare | cartridge "
             "| ICL | health failed | train min |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc_note = "" if r["acc_closure_points"] == r["points"] else f" [{r['acc_closure_points']} defined]"
        budget = f" in {r['minutes']:g} min" if r.get("minutes") else ""
        lines.append(
            f"| {r['conversations']:,}{budget} ({_num(r['conversations_used'], '{:.0f}')}) | {r['points']} "
            f"| {_num(r['nll_closure'])}{_ci(r['nll_closure_ci'])}{_over(r, 'nll_closure')} "
            f"| {_num(r['acc_closure'])}{_ci(r['acc_closure_ci'])}{_over(r, 'acc_closure')}{acc_note} "
            f"| {_pct(r['bare_accuracy'])} "
            f"| {_pct(r['cartridge_accuracy'])}{_pct_ci(r['cartridge_accuracy_ci'])} | {_pct(r['icl_accuracy'])} "
            f"| {r['health_failed']} "
            f"| {_num(r['train_wall_min'], '{:.1f}')} |")
    lines += ["", "Closure intervals resample each document's questions (* : the (doc, seed) points, where a "
              "point kept no per-question values or most resamples leave one undefined).", "", fit_line(f), "",
              "| doc | seed | conversations (used) | train args | held-out change | bare / cartridge / ICL accuracy "
              "| gold NLL bare / cartridge / ICL | NLL closure (95% CI) | accuracy closure (95% CI) | fact coverage "
              "| train min | eval min |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = sorted(records, key=lambda r: (int(r["conversations_planned"]), r["doc"], int(r["seed"])))
    for r in order:
        arms = r.get("arms") or {}
        shown = ("bare", "cartridge", "icl")  # the header's order
        nll = " / ".join(_num(arms.get(a, {}).get("gold_nll")) for a in shown)
        acc = " / ".join(_pct(arms.get(a, {}).get("accuracy")) for a in shown)
        health = "" if (r.get("train") or {}).get("health", "ok") == "ok" else " (health failed)"
        closures = [f"{_num(c.get('value'))}{_ci(c.get('ci'))}" if c.get("value") is not None
                    else f"n/a ({c.get('reason')})" for c in (r.get("icl_gap_closure_nll") or {},
                                                              r.get("icl_gap_closure") or {})]
        resumed = " (resumed)" if (r.get("train") or {}).get("skipped") else ""
        change = _num(r.get("heldout_change") and 100 * r["heldout_change"], "{:+.1f}%")
        lines.append(
            f"| {r['doc']} | {r['seed']} | {int(r['conversations_planned']):,} ({r.get('conversations_used')}) "
            f"| {' '.join(r.get('extra_train_args') or ()) or '(default)'} "
            f"| {change}{health} | {acc} | {nll} | {closures[0]} | {closures[1]} "
            f"| {_pct((r.get('train') or {}).get('fact_coverage'))} "
            f"| {_num(r.get('train_wall_s') and r['train_wall_s'] / 60, '{:.1f}')}{resumed} "
            f"| {_num(r.get('eval_wall_s') and r['eval_wall_s'] / 60, '{:.1f}')} |")
    return "\n".join(lines)


def plot_png(records: Sequence[dict], rows: Sequence[dict], f: dict, png: Path) -> None:
    """Two panels (accuracy closure, gold-NLL closure) against log conversations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    # The budgets measured (one row each), as plain numbers: log-scale minor labels (3x10^3, 4x10^3) collide.
    budgets = [r["conversations"] for r in rows]
    panels = (("icl_gap_closure", "acc_closure", "accuracy ICL-gap closure"),
              ("icl_gap_closure_nll", "nll_closure", "gold-option NLL ICL-gap closure"))
    for ax, (name, key, title) in zip(axes, panels, strict=True):
        for doc, pts in per_doc(records, name).items():
            ax.plot([n for n, _ in pts], [v for _, v in pts], lw=0.8, alpha=0.6, marker=".", label=doc)
        mean = [(r["conversations"], r[key], r[f"{key}_ci"]) for r in rows if r[key] is not None]
        if mean:
            xs = [n for n, _, _ in mean]
            ax.plot(xs, [v for _, v, _ in mean], color="black", lw=2, marker="o", label="mean over (doc, seed)")
            band = [(n, ci) for n, _, ci in mean if ci]
            if band:
                ax.fill_between([n for n, _ in band], [ci[0] for _, ci in band], [ci[1] for _, ci in band],
                                color="black", alpha=0.12, label="95% bootstrap interval")
        if key == "nll_closure" and f.get("slope_per_decade") is not None and mean:
            lo, hi = min(xs), max(xs)
            if f.get("n_at_target"):
                hi = max(hi, min(f["n_at_target"], hi * 100))
            grid = [lo * (hi / lo) ** (i / 50) for i in range(51)] if hi > lo else [lo]
            ax.plot(grid, [f["intercept"] + f["slope_per_decade"] * math.log10(x) for x in grid],
                    color="tab:red", ls="--", lw=1, label="fit (log10 n)")
        ax.axhline(TARGET, color="tab:green", ls=":", lw=1, label=f"target {TARGET}")
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_xticks(budgets, [f"{n:,}" for n in budgets])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("planned self-study conversations")
        ax.set_title(title)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("closure: (cartridge - bare) / (ICL - bare)")
    axes[1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    tmp = png.with_name(png.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
    os.replace(tmp, png)


def select(records: Sequence[dict], train_args: Sequence[str] | None, docs: Sequence[str] | None = None,
           minutes: float | None = None, dtype: str | None = None) -> list[dict]:
    """The points of one configuration (their extra train arguments), of `docs` and trained in `dtype`
    (None: all), sized by conversations or, given `minutes`, by that time budget."""
    return [r for r in records
            if (train_args is None or list(r.get("extra_train_args") or ()) == list(train_args))
            and (docs is None or r["doc"] in docs) and r.get("minutes") == minutes
            and dtype in (None, r.get("dtype"))]


def selected(outs: Sequence[Path], train_args: Sequence[str] | None, docs: Sequence[str] | None = None,
             minutes: float | None = None, dtype: str | None = None) -> list[dict]:
    """`select` over the results files' finished points. An empty selection is an error, and so is
    one point trained in several dtypes (`one_dtype_each`)."""
    records = select(read_all(outs), train_args, docs, minutes, dtype)
    if not records:
        which = "" if train_args is None else f" with train args {shlex.join(train_args)!r}"
        trained = "" if dtype is None else f" trained in {dtype}"
        raise SystemExit(f"curve: {', '.join(map(str, outs))} holds no finished point{which}{trained}; "
                         "run `python -m experiments.curve run` first")
    one_dtype_each(records, "one with --dtype")
    return records


def one_dtype_each(records: Sequence[dict], choose: str) -> None:
    """Refuse a point (document, seed, budget, train args) found in several training dtypes: their
    cartridges differ, so a mean would count the point twice and a pairing would take whichever
    ran last. `choose` says how to pick one."""
    dtypes: dict[tuple, set[str]] = {}
    for r in records:
        point = (r["doc"], int(r["seed"]), size_label(r.get("minutes"), int(r["conversations_planned"])),
                 tuple(r.get("extra_train_args") or ()))
        dtypes.setdefault(point, set()).add(str(r.get("dtype")))
    for (doc, seed, budget, args), found in dtypes.items():
        if len(found) > 1:
            raise SystemExit(f"curve: the point {doc} seed {seed} {budget} with train args {shlex.join(args)!r} "
                             f"was trained in {' and '.join(sorted(found))}; choose {choose}")


def plot(outs: Sequence[Path], png: Path | None, train_args: Sequence[str] | None = None,
         docs: Sequence[str] | None = None, minutes: float | None = None, dtype: str | None = None) -> dict:
    """One configuration's curve: a mean over (doc, seed) per budget only means something within one,
    and over the same documents at every budget (`docs`)."""
    records = selected(outs, train_args, docs, minutes, dtype)
    rows = aggregate(records)
    f = fit(rows)
    if png is not None:
        plot_png(records, rows, f, png)
    return {"out": [str(o) for o in outs], "png": None if png is None else str(png), "points": len(records), "rows": rows, "fit": f,
            "train_args": None if train_args is None else list(train_args), "records": records}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.curve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="train and evaluate every point not yet in the results file")
    p.add_argument("--docs", nargs="+", default=["raft", "photosynthesis", "panama"],
                   help="eval documents by name (docs/eval/NAME.md) or paths")
    p.add_argument("--seeds", nargs="+", type=int, default=[7, 8])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--conversations", nargs="+", type=int, default=[250, 500, 1000, 2000])
    size.add_argument("--minutes", type=float, default=None,
                      help="size each point by this time budget (`cartridges train --minutes`) instead")
    p.add_argument("--dtype", default="bfloat16", choices=("auto", "float32", "bfloat16", "float16"),
                   help="training dtype (self-study)")
    p.add_argument("--eval-dtype", default="float32", choices=("auto", "float32", "bfloat16", "float16"),
                   help="eval dtype (float32: the bare and ICL arms of QUALITY.md)")
    p.add_argument("--qa", default=str(EVAL_DIR / "questions.jsonl"))
    p.add_argument("--peers", action="store_true", help="also score the KV-compression peer arms")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--store", default=DEFAULT_STORE)
    p.add_argument("--extra-train-args", default="", help="further `cartridges train` options, one string")
    p.add_argument("--extra-eval-args", default="", help="further `cartridges eval` options, one string")
    p.add_argument("--run-args", default="",
                   help="`cartridges train` options that change how a point runs, not what it makes "
                        "(\"--task-runner dask --save-every 200\"); not part of the point's key")
    p.add_argument("--reuse-default-store", action="store_true",
                   help="start each point with extra train args from a copy of the default point's store "
                        "(its synthesis and teacher are reused where the arguments leave them unchanged); "
                        "with --minutes, the point trains the conversations its twin's budget chose")
    p.add_argument("--reuse-store-of", metavar="ARGS",
                   help="like --reuse-default-store, from the point whose extra train args are ARGS "
                        "(a lever against a non-default base, such as \"--p 256\")")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("plot", help="the curve as a PNG, a Markdown table and a log-linear fit")
    p.add_argument("--out", nargs="+", default=[DEFAULT_OUT], help="results files to look in")
    p.add_argument("--png", default=None,
                   help=f"where to draw the curve (default {DEFAULT_PNG}; none for --minutes, one budget is no curve)")
    p.add_argument("--train-args", default=None,
                   help="only the points run with these extra train arguments ('' for the defaults); default: all")
    p.add_argument("--docs", nargs="+", default=None, help="only these documents' points (names); default: all")
    p.add_argument("--minutes", type=float, default=None, help="the points sized by this time budget")
    p.add_argument("--dtype", default=None, help="only points trained in this dtype (as `run --dtype` named it)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("compare", help="two configurations' cartridges on the same questions (paired)")
    p.add_argument("--out", nargs="+", default=[DEFAULT_OUT], help="results files to look in")
    p.add_argument("--doc", nargs="+", required=True,
                   help="one document, or several: each compared, then the closure change over all of them")
    p.add_argument("--seed", "--seeds", dest="seed", nargs="+", type=int, required=True,
                   help="the seeds; several are paired per seed and pooled, a document's seeds sharing its draws")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--conversations", type=int, help="the points sized by this many conversations")
    size.add_argument("--minutes", type=float, help="the points sized by this time budget (twins at equal time)")
    p.add_argument("--base", default="", help="the base point's extra train arguments ('' for the defaults)")
    p.add_argument("--other", required=True, help="the other point's extra train arguments")
    p.add_argument("--other-conversations", type=int, default=None,
                   help="the other point's conversations (default: --conversations)")
    p.add_argument("--dtype", default=None, help="the training dtype, for a point trained in more than one")
    p.add_argument("--other-dtype", default=None, help="the other point's training dtype (default: --dtype)")
    p.add_argument("--other-out", nargs="+", default=None,
                   help="results files the other point is read from (default: --out), to pair one "
                        "configuration before and after a change its key does not see")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("peers", help="the points' closure against the compression peers' at the same rows (paired)")
    p.add_argument("--out", nargs="+", default=[DEFAULT_OUT], help="results files to read")
    p.add_argument("--eval-store", default=str(Path(DEFAULT_STORE) / "eval-store"),
                   help="the store of an eval that scored the peers on each document (`cli.main eval`)")
    p.add_argument("--train-args", default=None, help="only points with these extra train arguments ('' = defaults)")
    p.add_argument("--docs", nargs="+", default=None, help="only these documents' points (names); default: all")
    p.add_argument("--minutes", type=float, default=None, help="the points sized by this time budget")
    p.add_argument("--dtype", default=None, help="only points trained in this dtype (as `run --dtype` named it)")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("regions", help="each point's NLL closure on questions about the first p tokens and the rest")
    p.add_argument("--out", nargs="+", default=[DEFAULT_OUT], help="results files to read")
    p.add_argument("--train-args", default=None, help="only points with these extra train arguments ('' = defaults)")
    p.add_argument("--docs", nargs="+", default=None, help="only these documents' points (names); default: all")
    p.add_argument("--qa", default=str(EVAL_DIR / "questions.jsonl"))
    p.add_argument("--minutes", type=float, default=None, help="the points sized by this time budget")
    p.add_argument("--dtype", default=None, help="only points trained in this dtype (as `run --dtype` named it)")
    p.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "regions":
        rows = regions([Path(o) for o in args.out], None if args.train_args is None else shlex.split(args.train_args),
                       args.docs, Path(args.qa), args.dtype, args.minutes)
        for r in rows:
            parts = [f"{k} {_num(r[k]['closure'])} ({r[k]['questions']} questions)" for k in ("opening", "rest")]
            print(f"{r['doc']} seed {r['seed']} n {r['conversations']} p {r['p']} {r['dtype']} "
                  f"{shlex.join(r['train_args'])!r}: "
                  + ", ".join(parts))
        if args.json:
            print(json.dumps({"points": rows}), flush=True)
        return 0
    if args.command == "peers":
        records = selected([Path(o) for o in args.out],
                           None if args.train_args is None else shlex.split(args.train_args), args.docs, args.minutes,
                           args.dtype)
        v = versus_peers(records, Path(args.eval_store))
        c = v["cartridge"]
        print(f"{v['points']} points on {', '.join(v['documents'])} at {v['rows']} rows: cartridge NLL closure "
              f"{_num(c['closure'])}{_ci(c['closure_ci'])}")
        for r in v["peers"]:
            lead = "" if r["lead_ci"] is None else f" ({r['lead_ci'][0]:+.2f} to {r['lead_ci'][1]:+.2f})"
            print(f"  {r['arm']}: {_num(r['closure'])}{_ci(r['closure_ci'])}; cartridge lead {r['lead']:+.2f}{lead}"
                  + (" (best peer)" if r["arm"] == v["best_peer"] else ""))
        if args.json:
            print(json.dumps(v), flush=True)
        return 0
    if args.command == "compare":
        c = compare_docs([Path(o) for o in args.out], args.doc, args.seed, args.conversations,
                         shlex.split(args.base), shlex.split(args.other), args.other_conversations,
                         args.dtype, args.other_dtype, args.minutes,
                         [Path(o) for o in args.other_out] if args.other_out else None)
        for d in c["per_doc"]:
            closure = (f" = closure {d['closure_change']:+.3f} ({d['closure_change_ci'][0]:+.3f} to "
                       f"{d['closure_change_ci'][1]:+.3f})" if "closure_change" in d else "")
            budgets = size_label(d["minutes"], d["conversations"])
            if d["other_conversations"] != d["conversations"]:
                budgets = f"n {d['other_conversations']} against {budgets}"
            other, base = repr(args.other), repr(args.base)
            if d["dtype"] != d["other_dtype"]:  # twins trained in two dtypes: name each side's
                other, base = f"{d['other_dtype']} {other}", f"{d['dtype']} {base}"
            if args.other_out:  # one configuration from two results files: name each side's
                other, base = f"{other} ({' '.join(args.other_out)})", f"{base} ({' '.join(args.out)})"
            print(f"{d['doc']} seed {d['seed']} {budgets}: {other} against {base}: gold NLL "
                  f"{d['gold_nll_change']:+.3f} ({d['gold_nll_change_ci'][0]:+.3f} to "
                  f"{d['gold_nll_change_ci'][1]:+.3f}){closure}; lower on {d['better']} of {d['questions']} "
                  f"questions, higher on {d['worse']}")
        if len(c["per_doc"]) > 1 and c["closure_change"] is not None:
            lo, hi = c["closure_change_ci"]
            points = "" if c["points"] == c["documents"] else f", {c['points']} points"
            print(f"{c['documents']} document{'s' if c['documents'] > 1 else ''}{points}: closure {c['closure_change']:+.3f} ({lo:+.3f} to {hi:+.3f}), "
                  "each point's mean change averaged, questions resampled within their document")
        if args.json:
            print(json.dumps(c if len(c["per_doc"]) > 1 else c["per_doc"][0]), flush=True)
        return 0
    if args.command == "run":
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        summary = run_curve(args.docs, args.seeds, args.conversations, args.dtype, Path(args.out).resolve(),
                            Path(args.store).resolve(), shlex.split(args.extra_train_args), args.eval_dtype,
                            Path(args.qa).resolve(), args.peers, shlex.split(args.extra_eval_args),
                            reuse_default=args.reuse_default_store or args.reuse_store_of is not None,
                            reuse_of=shlex.split(args.reuse_store_of or ""), run_args=shlex.split(args.run_args),
                            minutes=args.minutes)
        log(f"curve: {len(summary['ran'])} ran, {len(summary['skipped'])} skipped, {len(summary['failed'])} failed "
            f"of {summary['points']} points; results in {summary['out']}")
        if args.json:
            print(json.dumps(summary), flush=True)
        return 1 if summary["failed"] else 0
    png = args.png or (None if args.minutes else DEFAULT_PNG)
    result = plot([Path(o) for o in args.out], None if png is None else Path(png), None if args.train_args is None else shlex.split(args.train_args),
                  args.docs, args.minutes, args.dtype)
    records = result.pop("records")
    if args.markdown:
        print(markdown(records, result["rows"], result["fit"]))
    else:
        print(fit_line(result["fit"]))
    print(f"plot: {result['png'] or 'no PNG'} ({result['points']} points)")
    if args.json:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
