"""The `retrain` flow: retrain the documents of a published fleet that changed, publish a new version.

Each step is a Prefect task (`flows/tasks.py`). Deployed as `retrain/scheduled` (see flows/deploy.py).
"""

from __future__ import annotations

from functools import partial

from prefect import flow

from cartridges.core.models import load_model
from flows.runners import fanout
from flows.tasks import as_task, publish_report
from jobs.retrain import notify_reload, retrain_config, run_retrain
from storage import Store


@flow(name="retrain", log_prints=True)
def retrain_flow(
    docs: list[str], fleet: str, preset: str | None = None, config: dict | None = None, model: str | None = None,
    device: str | None = None, dtype: str | None = None, store_root: str | None = None,
    serve_url: str | None = None,
    serve_pid_file: str | None = None, task_runner: str = "local", dask_address: str | None = None,
    lock_wait: float = 0.0,
) -> dict:
    """`fleet` is the fleet root (versions/ + current). Without `preset` the live fleet's own config
    is used, `config` overriding it. The reload goes to `serve_url` ($CARTRIDGES_SERVE_URL; API key
    from $CARTRIDGES_API_KEY) and/or SIGHUP to the PID in `serve_pid_file`. Another writer holding the
    root makes the run wait up to `lock_wait` seconds, then fail naming it."""
    cfg = retrain_config(fleet, preset, config)
    store = Store(store_root)
    lm = load_model(model, device, dtype)
    notify = partial(notify_reload, serve_url, serve_pid_file)
    with fanout(task_runner, dask_address, model, device, lm.dtype_record()["dtype"], lm=lm) as workers:
        summary = run_retrain(store, lm, docs, fleet, cfg, call=as_task, fanout=workers, notify=notify,
                              lock_wait=lock_wait)
    publish_report(summary, "retrain-summary", "fleet retrain run")
    return summary
