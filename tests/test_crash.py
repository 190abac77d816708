"""SIGKILL the fleet flow at named fault points; the rerun must reach exactly the clean run's results.

Each case runs `cartridges fleet` (tiny model, smoke preset, 6 rounds) in a child process
with `CARTRIDGES_FAULT=<point>` so the kernel kills it there, checks the store's invariants
right after the kill, reruns the command the way a user would, and compares cartridge
rows, optimizer moments, every fleet file, the content-keyed artifacts and their rows, and
the `train_steps` table with those of one uninterrupted run.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.crash import check_store, compare, fleet_argv, rerun, run_cli, trace_points
from tests.test_fleet_run import write_docs

pytestmark = pytest.mark.reliability
ROUNDS = 6

# (CARTRIDGES_FAULT value, where the process dies). `@n`: the n-th time the point is reached.
KILL_POINTS = [
    ("ingest.shard.0", "ingest: documents shard written, artifact not yet complete"),
    ("fleet.prepare.1", "first initialization: two of three cartridges written, no manifest yet"),
    ("atomic.write.fleet.json@1", "first manifest: temp file whole, not yet renamed"),
    ("synthesize.questions@2", "mid-synthesis: questions generated, answers not"),
    ("fleet.data.conversations@4", "round 0: conversations written, teacher targets not"),
    ("teacher.batch@5", "mid-teacher: targets computed, not written"),
    ("fleet.round.0", "after a trained round, before any checkpoint"),
    ("fleet.save.optimizer@5", "checkpoint: a cartridge's rows written, its moments not"),
    ("atomic.write.*.adam.safetensors@5", "checkpoint: a moment file's temp whole, not renamed"),
    ("fleet.checkpoint.resident.*@1", "checkpoint: one resident saved, the other not"),
    ("fleet.checkpoint.manifest@1", "checkpoint: manifest written, superseded files not pruned"),
    ("fleet.round.4", "between checkpoints, late in the run"),
    ("fleet.steps.shard@3", "recording train_steps: half the shards written"),
    ("fleet.steps.recorded", "train_steps recorded, journal not cleared"),
    ("fleet.index.faiss", "mid-index: faiss file written, chunks and centroid not"),
    ("fleet.publish.manifest", "index built, final manifest not written"),
    ("atomic.write.fleet.json@6", "final manifest: temp file whole, not renamed"),
    ("fleet.publish.prune", "final manifest written, superseded files not pruned"),
]
# The suite kills at one point per stage (a few minutes on 2 cores); CARTRIDGES_CRASH_ALL=1, or
# `python -m bench.crash_fleet`, tries every point above.
SUITE = ("ingest.shard.0", "fleet.prepare.1", "synthesize.questions@2", "teacher.batch@5", "fleet.round.0",
         "fleet.save.optimizer@5", "fleet.checkpoint.manifest@1", "fleet.steps.shard@3", "fleet.index.faiss",
         "fleet.publish.manifest", "atomic.write.fleet.json@6")
CASES = KILL_POINTS if os.environ.get("CARTRIDGES_CRASH_ALL") else [k for k in KILL_POINTS if k[0] in SUITE]


@pytest.fixture(scope="module")
def clean(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("crash")
    docs = write_docs(root / "docs")
    run_dir = root / "clean"
    code = run_cli(fleet_argv(tiny_model_dir, docs, run_dir, ROUNDS), root / "clean.log", trace=root / "trace")
    assert code == 0, (root / "clean.log").read_text()[-3000:]
    return root, docs, trace_points(root / "trace")


def test_every_stage_of_the_run_has_kill_points(clean):
    _, _, trace = clean
    families = ("ingest.", "fleet.prepare.", "synthesize.", "teacher.", "fleet.round.", "fleet.checkpoint.",
                "fleet.save.", "fleet.steps.", "fleet.index.", "fleet.publish.", "atomic.write.")
    assert all(any(p.startswith(f) for p in trace) for f in families)
    assert set(SUITE) <= {k for k, _ in KILL_POINTS}
    chosen = {spec.split("@")[0] for spec in SUITE}
    assert {f for f in families if any(c.startswith(f) for c in chosen)} == set(families)


@pytest.mark.parametrize(("fault", "where"), CASES, ids=[k for k, _ in CASES])
def test_killed_run_reruns_to_the_clean_result(clean, tmp_path, tiny_model_dir, fault, where):
    root, docs, _ = clean
    crashed = tmp_path / "crashed"
    code = run_cli(fleet_argv(tiny_model_dir, docs, crashed, ROUNDS), tmp_path / "crash.log", fault=fault)
    assert code == -9, f"{fault} ({where}) was not reached: exit {code}\n" + (tmp_path / "crash.log").read_text()[-2000:]
    if (crashed / "store" / "catalog.duckdb").exists():
        check_store(crashed / "store")  # nothing marked complete is partial, even before the rerun
    code = rerun(tiny_model_dir, docs, crashed, ROUNDS)
    assert code == 0, (crashed / "rerun.log").read_text()[-3000:]
    assert compare(root / "clean", crashed, ROUNDS) == []
    shutil.rmtree(crashed)
