"""Where a flow's independent pieces run: in the flow process, or on Dask workers (prefect-dask).

`fanout(...)` yields a `stages.fanout.Fanout`. In-process ("local") it runs the jobs on
this process's cores (`stages.fanout.in_process`; None where that gains nothing). With
"dask", its `map` submits each job as a Prefect task to a `DaskTaskRunner`: a temporary
LocalCluster, or the scheduler at `dask_address` (workers on other machines need
the same code, model files and store root, e.g. a shared filesystem).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from prefect import task
from prefect.cache_policies import NONE

from cartridges.core.models import LoadedModel
from stages.fanout import Fanout, WorkerModel, in_process

RUNNERS = ("local", "dask")


def _api_for_workers() -> contextlib.AbstractContextManager:
    """Without a configured Prefect API the flow uses a temporary local server; hand its
    address to the workers (through the task context) so they report to it instead of
    each starting one of their own."""
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    if get_current_settings().api.url:
        return contextlib.nullcontext()
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start()
    return temporary_settings({PREFECT_API_URL: server.api_url})


def _worker_malloc() -> contextlib.AbstractContextManager:
    """Spawn local workers with glibc's own malloc thresholds.

    Dask's nanny sets MALLOC_TRIM_THRESHOLD_ in its workers, which also fixes glibc's mmap
    threshold: every tensor over 128 KiB is then mapped and page-faulted afresh. A
    single-thread bfloat16 synthesis shard of 64 conversations took 70.8 s that way against
    47.9 s without it (2-core AMD EPYC), 27 s of it in the kernel.
    """
    import dask

    return dask.config.set({"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None})


@contextlib.contextmanager
def fanout(task_runner: str = "local", dask_address: str | None = None, model: str | None = None,
           device: str | None = None, dtype: str | None = None, dask_workers: int | None = None,
           lm: LoadedModel | None = None) -> Iterator[Fanout | None]:
    """`lm` is the flow's loaded model, which the in-process jobs share."""
    if task_runner not in RUNNERS:
        raise ValueError(f"task runner {task_runner!r}: choose one of {', '.join(RUNNERS)}")
    if task_runner == "local":
        yield None if lm is None else in_process(lm, model, device)
        return
    from prefect_dask import DaskTaskRunner

    threads, workers = torch.get_num_threads(), 1
    if dask_address:
        runner = DaskTaskRunner(address=dask_address)
    else:
        workers = dask_workers or 2
        # The local workers share this machine's cores: split the flow's threads between them.
        threads = max(1, threads // workers)
        runner = DaskTaskRunner(cluster_kwargs={"n_workers": workers, "threads_per_worker": 1,
                                                "processes": True, "dashboard_address": None})
    with _api_for_workers(), _worker_malloc(), runner:
        # Stages call `map` from inside their own task run; submit in the flow's context instead
        # (a task run's context does not serialize), so the pieces are tasks of the flow run.
        flow_context = contextvars.copy_context()

        def submit_all(fn, jobs, done=None):
            piece = task(fn, name=fn.__name__, cache_policy=NONE, persist_result=False)
            futures = flow_context.copy().run(lambda: [runner.submit(piece, {"job": job}) for job in jobs])
            results = []
            for job, future in zip(jobs, futures, strict=True):  # in order: workers take jobs in order too
                results.append(future.result())
                if done:
                    done(job)
            return results

        yield Fanout(map=submit_all, model=WorkerModel(model, device, threads, dtype), workers=workers)
