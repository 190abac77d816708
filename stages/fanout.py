"""Independent pieces of a stage (shards, documents) run side by side.

A stage that can fan out takes a `Fanout`: a `map(fn, jobs, done)` that runs `fn(job)`
for every job somewhere, calls `done(job)` as each result comes back (the stage's progress
bar) and returns the results in order, plus the model reference the workers load. Jobs
carry only plain data (configs as dicts, rows, paths); a worker loads the model once per
process, with the thread count the flow gives it, computes, and writes its own output
files (Parquet shards, cartridge files) under the store root, which may be a shared
filesystem. Workers never open the catalog: the stage's `store.run` in the flow process
records the artifact once every shard is written.

Two kinds exist. The flow's Dask workers (`flows.runners`) are other processes. In this
process, `in_process` runs the jobs on one Python thread per core, each at one torch thread:
the small model's generation parallelizes poorly inside one operator, so two single-thread
shards side by side beat one shard on two threads (on a 2-core CPU without native bfloat16,
32 float32 conversations took 58 s on two threads of one process, 56 s on two processes and
74 s on one two-thread process; `make bench-fanout` measures it on the machine at hand).
Nothing here knows about Prefect or Dask.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from cartridges.core.models import LoadedModel, load_model
from cartridges.core.speed import dtype_name
from stages.progress import Bar


class Map(Protocol):
    def __call__(self, fn: Callable[[Any], Any], jobs: list[Any],
                 done: Callable[[Any], None] | None = None) -> list[Any]: ...


@dataclass(frozen=True)
class WorkerModel:
    """How a worker loads the flow's model: the same spec, device and dtype, the same thread count."""

    spec: str | None
    device: str | None
    threads: int
    dtype: str | None = None

    @property
    def key(self) -> tuple:
        """What makes two references the same loaded model (the thread count does not)."""
        return (self.spec, self.device, self.dtype)


@dataclass(frozen=True)
class Fanout:
    map: Map
    model: WorkerModel
    workers: int = 1  # how many jobs run at once (1 where the cluster's size is not known)


def report_resumed_shards(bar: Bar, items: Sequence, size: int, done: Iterable[int]) -> None:
    """Tell a progress bar the `items` (in shards of `size`) that an earlier run finished."""
    resumed = sum(len(items[shard * size : (shard + 1) * size]) for shard in done)
    if resumed:
        bar.resume(resumed)


_MODELS: dict[tuple, LoadedModel] = {}
_LOCK = threading.Lock()


def worker_model(ref: WorkerModel) -> LoadedModel:
    """The model for this process (loaded on first use), with the flow's thread count set."""
    torch.set_num_threads(ref.threads)
    with _LOCK:
        if ref.key not in _MODELS:
            _MODELS[ref.key] = load_model(ref.spec, ref.device, ref.dtype)
        return _MODELS[ref.key]


def in_process(lm: LoadedModel, spec: str | None = None, device: str | None = None) -> Fanout | None:
    """A fanout over this process's cores for `lm` (module docstring), or None where there is
    nothing to gain: a model off the CPU, or a single thread."""
    workers = torch.get_num_threads()
    if lm.device.type != "cpu" or workers < 2:
        return None
    ref = WorkerModel(spec, device, 1, dtype_name(lm.dtype))
    with _LOCK:
        _MODELS[ref.key] = lm  # the jobs use the flow's own model

    def map_threads(fn: Callable[[Any], Any], jobs: list[Any], done: Callable[[Any], None] | None = None) -> list[Any]:
        if not jobs:
            return []
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # process-wide: every job runs on one thread, as a Dask worker does
        pool = ThreadPoolExecutor(max_workers=min(workers, len(jobs)), thread_name_prefix="fanout")
        try:
            futures = {pool.submit(fn, job): i for i, job in enumerate(jobs)}  # taken in order, as workers take them
            results: list[Any] = [None] * len(jobs)
            for future in as_completed(futures):
                i = futures[future]
                results[i] = future.result()  # the first failure stops the rest; finished shards stay
                if done:
                    done(jobs[i])
            return results
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            torch.set_num_threads(threads)

    return Fanout(map=map_threads, model=ref, workers=workers)
