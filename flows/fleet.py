"""The `fleet` flow: documents to a trained fleet directory, each step a Prefect task.

The steps are the fleet job's (`jobs/fleet.py`): ingest -> prepare -> heldout -> rounds ->
evaluate -> record -> index -> publish; each round's data and training step is a task of
its own. Runs with ephemeral Prefect when no server is configured.
"""

from __future__ import annotations

from functools import partial

from prefect import flow

from cartridges.core.models import load_model
from flows.runners import fanout
from flows.tasks import as_task, publish_report
from jobs.fleet import STEPS, fleet_run
from jobs.retrain import notify_reload, run_retrain
from schemas.presets import fleet_preset
from storage import Store


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
    with fanout(task_runner, dask_address, model, device, lm.dtype_record()["dtype"], lm=lm) as workers:
        if publish:
            summary = run_retrain(store, lm, docs, fleet, cfg, call=as_task, fanout=workers, only_changed=False,
                                  notify=partial(notify_reload, serve_url, serve_pid_file), lock_wait=lock_wait)
        else:
            with fleet_run(store, lm, docs, fleet, cfg, resume=resume, eval_distractors=eval_distractors,
                           fanout=workers, lock_wait=lock_wait) as run:
                for step in STEPS:  # ingest -> prepare -> heldout -> rounds -> evaluate -> record -> index -> publish
                    run.step(step, call=as_task)
            summary = run.summary
    publish_report(summary, "fleet-summary", "fleet training run")
    return summary
