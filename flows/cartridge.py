"""The `cartridge` flow: one corpus to one trained cartridge, each stage a Prefect task.

The chain is the stage graph (`stages/graph.py`): ingest -> chunks -> synthesize ->
facts -> teacher -> train. Runs with ephemeral Prefect when no server is configured.
"""

from __future__ import annotations

from prefect import flow

from cartridges.core.models import load_model
from flows.runners import fanout
from flows.tasks import as_task, publish_report
from jobs.pipeline import cartridge_run
from schemas.presets import preset as pipeline_preset
from stages.graph import CARTRIDGE
from storage import Store


@flow(name="cartridge", log_prints=True)
def cartridge_flow(
    corpus: list[str], config: dict | None = None, model: str | None = None, device: str | None = None,
    dtype: str | None = None,
    store_root: str | None = None, save: str | None = None, force: list[str] | None = None,
    preset: str = "default", task_runner: str = "local", dask_address: str | None = None,
) -> dict:
    """`config` overrides the `preset`; `task_runner="dask"` runs synthesis and teacher shards on
    Dask workers (a local cluster, or the scheduler at `dask_address`)."""
    cfg = pipeline_preset(preset, config or {})
    store = Store(store_root)
    lm = load_model(model, device, dtype)
    with fanout(task_runner, dask_address, model, device, lm.dtype_record()["dtype"], lm=lm) as workers:
        with cartridge_run(store, lm, corpus, cfg, save, tuple(force or ()), workers) as run:
            for stage in CARTRIDGE:  # ingest -> chunks -> synthesize -> facts -> teacher -> train
                run.stage(stage, call=as_task)
    publish_report(run.summary, "cartridge-summary", "cartridge training run")
    return run.summary
