"""Scale-out on Dask (prefect-dask): shards and document initialization on worker processes
give the same Parquet rows and cartridge files as the in-process run."""

from __future__ import annotations

import pytest

from cartridges.core.models import load_model
from jobs.fleet import run_fleet
from jobs.pipeline import run_pipeline
from schemas.presets import fleet_preset, preset
from storage import Store
from tests.test_fleet_run import contents_of, quiet, write_docs
from tests.test_pipeline import CORPUS

distributed = pytest.importorskip("distributed")


@pytest.fixture(scope="module")
def cluster():
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as c:
        yield c


def table(store_root, stage):
    store = Store(store_root)
    return store.table(store.latest(stage)).to_pylist()


def test_synthesis_and_teacher_shards_on_two_dask_workers_equal_the_in_process_run(
        tmp_path, tiny_model_dir, cluster, monkeypatch):
    from flows.cartridge import cartridge_flow
    from tests.test_pipeline import _record_bars

    corpus = tmp_path / "corpus.md"
    corpus.write_text(CORPUS)
    common = {"corpus": [str(corpus)], "model": str(tiny_model_dir), "preset": "smoke",
              "config": {"synth": {"filter": False, "gen_batch": 4}}}
    local = run_pipeline(Store(tmp_path / "local"), load_model(str(tiny_model_dir)), [corpus],
                         preset("smoke", common["config"]))
    bars, updates = _record_bars(monkeypatch)
    spread = cartridge_flow(**common, store_root=str(tmp_path / "dask"), task_runner="dask",
                            dask_address=cluster.scheduler_address)
    # the bars move as the workers' shards come back, not only at the end
    assert updates["self-study"] == [4, 4, 2] and bars["self-study"].n == bars["self-study"].total == 10
    assert sum(updates["teacher"]) == bars["teacher"].n == bars["teacher"].total == 10
    convs = table(tmp_path / "local", "synthesize")
    assert len(convs) == 10
    store = Store(tmp_path / "dask")
    shards = sorted(p.name for p in store.dir(store.latest("synthesize")).iterdir())
    assert shards == [f"part-{i:05d}.parquet" for i in range(3)]  # one per gen_batch, written by the workers
    assert table(tmp_path / "dask", "synthesize") == convs
    assert table(tmp_path / "dask", "teacher") == table(tmp_path / "local", "teacher")
    assert spread["losses"] == local["losses"] and len(local["losses"]) > 0
    assert [a.stage for a in store.catalog.artifacts() if a.status == "complete"] == [
        a.stage for a in Store(tmp_path / "local").catalog.artifacts() if a.status == "complete"]


def test_document_initialization_on_dask_workers_writes_the_same_cartridges(tmp_path, tiny_model_dir, cluster):
    from flows.fleet import fleet_flow

    docs = write_docs(tmp_path / "docs")
    common = {"docs": [str(docs)], "model": str(tiny_model_dir), "preset": "smoke", "config": {"rounds": 1}}
    run_fleet(Store(tmp_path / "s1"), load_model(str(tiny_model_dir)), [docs], tmp_path / "local",
              fleet_preset("smoke", common["config"]), log=quiet)
    fleet_flow(**common, fleet=str(tmp_path / "dask"), store_root=str(tmp_path / "s2"), task_runner="dask",
               dask_address=cluster.scheduler_address)

    local = contents_of(tmp_path / "local")
    assert contents_of(tmp_path / "dask") == local and len(local) == 6


def test_local_workers_split_the_flows_threads_and_a_remote_cluster_keeps_them(monkeypatch):
    """Two local workers each with the flow's whole thread count would oversubscribe its cores."""
    import contextlib

    import prefect_dask
    import torch

    from flows import runners

    made = []

    class Runner:
        def __init__(self, **kwargs):
            made.append(kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(prefect_dask, "DaskTaskRunner", Runner)
    monkeypatch.setattr(runners, "_api_for_workers", contextlib.nullcontext)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        with runners.fanout("dask", dask_workers=2) as local:
            assert local.model.threads == 2 and made[-1]["cluster_kwargs"]["n_workers"] == 2
        with runners.fanout("dask", dask_workers=8) as many:
            assert many.model.threads == 1
        with runners.fanout("dask", dask_address="tcp://elsewhere:8786") as remote:
            assert remote.model.threads == 4 and made[-1] == {"address": "tcp://elsewhere:8786"}
    finally:
        torch.set_num_threads(before)


def test_local_workers_spawn_without_the_nannys_malloc_trim_threshold(monkeypatch):
    """Dask's default MALLOC_TRIM_THRESHOLD_ pins glibc's mmap threshold, so every large tensor a
    worker allocates is mapped afresh; the flow's workers are spawned without it."""
    import contextlib

    import prefect_dask
    from distributed.nanny import _get_env_variables

    from flows import runners

    key = "distributed.nanny.pre-spawn-environ"
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    seen = []

    class Runner:
        def __init__(self, **kwargs):
            pass

        def __enter__(self):  # where the LocalCluster's nannies would spawn their workers
            seen.append(_get_env_variables(key))
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(prefect_dask, "DaskTaskRunner", Runner)
    monkeypatch.setattr(runners, "_api_for_workers", contextlib.nullcontext)
    assert "MALLOC_TRIM_THRESHOLD_" in _get_env_variables(key)  # dask's default, under this name
    with runners.fanout("dask", dask_workers=2):
        pass
    assert "MALLOC_TRIM_THRESHOLD_" not in seen[0] and seen[0]["OMP_NUM_THREADS"] == "1"
    assert "MALLOC_TRIM_THRESHOLD_" in _get_env_variables(key)  # restored for everything else
