"""The `fleet` flow: documents to a trained fleet directory, each step a Prefect task.

Prefect's own task caching is off (`cache_policy=NONE`): the catalog's fingerprints
are the one cache. Runs with ephemeral Prefect when no server is configured.
"""

from __future__ import annotations

from functools import partial

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE
from prefect.utilities.annotations import quote

from cartridges.core.models import load_model
from flows.runners import fanout
from schemas.presets import fleet_preset
from stages.fleet import run_fleet
from stages.fleet_report import markdown_summary
from stages.retrain import markdown_summary as retrain_markdown
from stages.retrain import notify_reload, run_retrain
from storage import Store


def as_task(fn, *args, **kwargs):
    """Run one step as a Prefect task named after the function (arguments passed untouched)."""
    name = getattr(fn, "__name__", "step").strip("_")
    wrapped = task(fn, name=name, cache_policy=NONE, persist_result=False)
    return wrapped(*[quote(a) for a in args], **{k: quote(v) for k, v in kwargs.items()})


@flow(name="fleet", log_prints=True)
def fleet_flow(
    docs: list[str], fleet: str, config: dict | None = None, model: str | None = None, device: str | None = None,
    dtype: str | None = None,
    store_root: str | None = None, resume: bool = False, eval_distractors: int = 0, preset: str = "default",
    task_runner: str = "local", dask_address: str | None = None, publish: bool = False,
    serve_url: str | None = None, serve_pid_file: str | None = None, lock_wait: float = 0.0,
) -> dict:
    """`config` overrides the `preset`; `task_runner="dask"` initializes new and changed documents
    on Dask workers (a local cluster, or the scheduler at `dask_address`). With `publish`, `fleet`
    is a fleet root: the run builds the next version from the current one, switches `current` to
    it and tells a running server to reload (as the retrain flow does, but always training). Another
    writer holding the directory (or root) makes the run wait up to `lock_wait` seconds, then fail."""
    cfg = fleet_preset(preset, config or {})
    store = Store(store_root)
    lm = load_model(model, device, dtype)
    with fanout(task_runner, dask_address, model, device, lm.dtype_record()["dtype"]) as workers:
        if publish:
            summary = run_retrain(store, lm, docs, fleet, cfg, call=as_task, fanout=workers, only_changed=False,
                                  notify=partial(notify_reload, serve_url, serve_pid_file), lock_wait=lock_wait)
            markdown = retrain_markdown(summary)
        else:
            summary = run_fleet(store, lm, docs, fleet, cfg, resume=resume, call=as_task,
                                eval_distractors=eval_distractors, fanout=workers, lock_wait=lock_wait)
            markdown = markdown_summary(summary)
    create_markdown_artifact(markdown=markdown, key="fleet-summary", description="fleet training run")
    return summary
