"""In-process fanout: shards side by side on this process's cores, one torch thread each,
give the rows of a one-thread run, in order, and stop at the first failure."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cartridges.core.models import load_model
from jobs.pipeline import run_pipeline
from schemas.presets import preset
from stages.fanout import in_process, worker_model
from storage import Store
from tests.test_pipeline import CORPUS


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def table(root, stage):
    store = Store(root)
    return store.table(store.latest(stage)).to_pylist()


def test_shards_side_by_side_equal_a_one_thread_run(tmp_path, tiny_model_dir, two_threads):
    corpus = tmp_path / "corpus.md"
    corpus.write_text(CORPUS)
    config = preset("smoke", {"synth": {"filter": False, "gen_batch": 4}})
    lm = load_model(str(tiny_model_dir))
    fanout = in_process(lm, str(tiny_model_dir))
    assert fanout is not None and fanout.workers == 2 and fanout.model.threads == 1
    assert worker_model(fanout.model) is lm  # the jobs share the flow's model
    torch.set_num_threads(2)
    run_pipeline(Store(tmp_path / "side"), lm, [corpus], config, fanout=fanout)
    assert torch.get_num_threads() == 2  # training got the cores back
    torch.set_num_threads(1)
    run_pipeline(Store(tmp_path / "one"), lm, [corpus], config)
    convs = table(tmp_path / "one", "synthesize")
    assert len(convs) == 10
    store = Store(tmp_path / "side")
    assert len(list(store.dir(store.latest("synthesize")).iterdir())) == 3  # one shard per gen_batch
    assert table(tmp_path / "side", "synthesize") == convs
    assert table(tmp_path / "side", "teacher") == table(tmp_path / "one", "teacher")


def test_map_runs_jobs_together_on_one_thread_each_and_keeps_their_order(tiny_model_dir, two_threads):
    fanout = in_process(load_model(str(tiny_model_dir)))
    meet = threading.Barrier(2, timeout=30)  # broken unless two jobs run at once
    seen, done = [], []

    def job(n: int) -> int:
        seen.append(torch.get_num_threads())
        if n < 2:
            meet.wait()
        return n * n

    assert fanout.map(job, [0, 1, 2, 3], done.append) == [0, 1, 4, 9]
    assert seen == [1, 1, 1, 1] and sorted(done) == [0, 1, 2, 3]
    assert torch.get_num_threads() == 2


def test_the_first_failure_stops_the_map_and_restores_the_threads(tiny_model_dir, two_threads):
    fanout = in_process(load_model(str(tiny_model_dir)))
    finished = []

    def job(n: int) -> int:
        if n == 1:
            raise ValueError("shard 1 failed")
        time.sleep(0.05)
        finished.append(n)
        return n

    with pytest.raises(ValueError, match="shard 1 failed"):
        fanout.map(job, list(range(40)))
    assert 0 in finished and len(finished) < 39  # the queued jobs were cancelled
    assert torch.get_num_threads() == 2


def test_one_thread_gains_nothing(tiny_model_dir):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert in_process(load_model(str(tiny_model_dir))) is None
    finally:
        torch.set_num_threads(before)
