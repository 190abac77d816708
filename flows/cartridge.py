"""The `cartridge` flow: one corpus to one trained cartridge, each stage a Prefect task.

Prefect's own task caching is off (`cache_policy=NONE`): the catalog's fingerprints
are the one cache. Runs with ephemeral Prefect when no server is configured.
"""

from __future__ import annotations

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE
from prefect.utilities.annotations import quote

from cartridges.core.models import load_model
from flows.runners import fanout
from schemas.presets import preset as pipeline_preset
from stages.pipeline import run_pipeline
from stages.report import markdown_summary
from storage import Store


def as_task(fn, *args, **kwargs):
    """Run one stage function as a Prefect task (arguments passed through untouched)."""
    name = fn.__module__.rsplit(".", 1)[-1]
    wrapped = task(fn, name=name, cache_policy=NONE, persist_result=False)
    return wrapped(*[quote(a) for a in args], **{k: quote(v) for k, v in kwargs.items()})


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
    with fanout(task_runner, dask_address, model, device, lm.dtype_record()["dtype"]) as workers:
        summary = run_pipeline(store, lm, corpus, cfg, save=save, force=tuple(force or ()), call=as_task,
                               fanout=workers)
    create_markdown_artifact(markdown=markdown_summary(summary), key="cartridge-summary",
                             description="cartridge training run")
    return summary
