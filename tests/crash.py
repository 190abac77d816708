"""Crash harness: run `cartridges fleet` in a child process, SIGKILL it at a named fault point, rerun.

Children come from a forkserver that has imported the project once, so each run costs
the run itself (a few seconds on the tiny model) rather than a fresh interpreter's imports;
each is still a separate process that the kernel kills with SIGKILL, mid-write and all.
"""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

from storage import Store, shards
from storage.atomic import is_temp
from storage.faults import ENV, TRACE_ENV

TIMEOUT_S = 300
# Stages whose artifacts are keyed by content alone: after a crash and rerun the store must
# hold exactly the same complete versions, with the same rows.
KEYED_STAGES = ("ingest", "fleet_heldout", "fleet_round")

_CTX = None


def context():
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(["tests.crash_child"])
    return _CTX


def run_cli(argv: list[str], log: Path, fault: str | None = None, trace: Path | None = None,
            env: dict[str, str] | None = None) -> int:
    """`cartridges <argv>` in a child process (with `env` set); returns its exit code (-9 when killed)."""
    from tests.crash_child import main

    env = {ENV: fault or "", TRACE_ENV: str(trace) if trace else "", **(env or {})}
    proc = context().Process(target=main, args=(argv, env, str(log)))
    proc.start()
    proc.join(TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise AssertionError(f"cartridges {' '.join(argv)} hung (over {TIMEOUT_S} s); log {log}")
    return proc.exitcode


def fleet_argv(model: Path, docs: Path, root: Path, rounds: int, resume: bool = False) -> list[str]:
    return ["fleet", "--docs", str(docs), "--model", str(model), "--fleet", str(root / "fleet"),
            "--store", str(root / "store"), "--preset", "smoke", "--rounds", str(rounds), "--no-prefect",
            *(["--resume"] if resume else [])]


def rerun(model: Path, docs: Path, root: Path, rounds: int) -> int:
    """What a user does after a crash: the same command, resuming when a fleet exists, for the
    rounds still missing (a resume's `--rounds` counts rounds to add)."""
    manifest = root / "fleet" / "fleet.json"
    done = json.loads(manifest.read_text())["rounds"] if manifest.is_file() else 0
    argv = fleet_argv(model, docs, root, rounds - done, resume=manifest.is_file())
    return run_cli(argv, root / "rerun.log")


def safetensors_contents(path: Path) -> tuple[dict, dict]:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return f.metadata(), {k: f.get_tensor(k).numpy().tobytes() for k in f.keys()}


def fleet_state(directory: Path) -> dict:
    """Every file of the fleet directory: safetensors by header and tensor bytes, others by bytes."""
    out = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            rel = path.relative_to(directory).as_posix()
            if path.suffix == ".safetensors":
                out[rel] = safetensors_contents(path)
            elif rel == "fleet.json":  # `config.rounds` is the last command's argument, not fleet state
                manifest = json.loads(path.read_text())
                manifest["config"].pop("rounds", None)
                manifest.pop("checksum", None)  # covers config.rounds
                out[rel] = manifest
            else:
                out[rel] = path.read_bytes()
    return out


def check_store(root: Path) -> dict:
    """Catalog invariants that hold after any crash: every `complete` artifact is whole (its
    shards read, its row count matches the catalog, no temp files), no rows are duplicated
    within a table. Returns {stage: {fingerprint: {table: rows}}} of complete artifacts."""
    store = Store(root, read_only=True)
    out: dict[str, dict] = {}
    for art in store.catalog.artifacts():
        if art.status != "complete":
            continue
        directory = store.dir(art)
        assert directory.is_dir(), f"{art.id} is complete but has no directory"
        assert not [p for p in directory.rglob("*") if is_temp(p)], f"{art.id}: temp files left"
        tables = {"": shards.read_table(directory)} if shards.done_shards(directory) else {
            d.name: shards.read_table(d) for d in sorted(directory.iterdir()) if d.is_dir()}
        assert sum(t.num_rows for t in tables.values()) == art.rows, f"{art.id}: row count differs"
        for name, table in tables.items():
            rows = table.to_pylist()
            keys = [json.dumps(r, sort_keys=True, default=str) for r in rows]
            assert len(set(keys)) == len(keys), f"{art.id}/{name}: duplicated rows"
        out.setdefault(art.stage, {})[art.fingerprint] = {k: t.to_pylist() for k, t in tables.items()}
    return out


def latest_steps(root: Path) -> list[dict]:
    """The `train_steps` rows of the newest complete fleet record, without run id and timing."""
    store = Store(root, read_only=True)
    art = store.latest("fleet")
    if art is None:
        return []
    rows = store.table(art, "train_steps").to_pylist()
    return [{k: v for k, v in r.items() if k not in ("run_id", "seconds")} for r in rows]


def compare(clean: Path, crashed: Path, rounds: int) -> list[str]:
    """Differences between a clean run's results and a crashed-then-rerun one (empty: equal)."""
    problems = []
    a, b = fleet_state(clean / "fleet"), fleet_state(crashed / "fleet")
    if set(a) != set(b):
        problems.append(f"fleet files differ: only clean {sorted(set(a) - set(b))}, "
                        f"only crashed {sorted(set(b) - set(a))}")
    problems += [f"fleet file {name} differs" for name in sorted(set(a) & set(b)) if a[name] != b[name]]
    sa, sb = check_store(clean / "store"), check_store(crashed / "store")
    for stage in KEYED_STAGES:
        if sa.get(stage) != sb.get(stage):
            problems.append(f"stage {stage}: complete artifacts or their rows differ")
    steps = latest_steps(crashed / "store")
    if steps != latest_steps(clean / "store"):
        problems.append(f"train_steps differ: {[r['step'] for r in steps]}")
    if [r["step"] for r in steps] != list(range(rounds)):
        problems.append(f"train_steps has steps {[r['step'] for r in steps]}, want 0..{rounds - 1}")
    runs = Store(crashed / "store", read_only=True).catalog.runs()
    if not runs or runs[-1]["status"] != "complete":
        problems.append("the rerun's run is not recorded complete")
    return problems


def trace_points(trace: Path) -> list[str]:
    return trace.read_text().split() if trace.is_file() else []
