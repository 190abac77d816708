"""Independent pieces of a stage (shards, documents) sent to other processes.

A stage that can fan out takes a `Fanout`: a `map(fn, jobs, done)` that runs `fn(job)`
for every job somewhere (the flow passes one backed by Dask workers), calls `done(job)`
as each result comes back (the stage's progress bar) and returns the results in order,
plus the model reference the workers load. Jobs carry only plain
data (configs as dicts, rows, paths); a worker loads the model once per process,
with the thread count the flow gives it (a share of its own on a local cluster), computes, and writes its own output files (Parquet
shards, cartridge files) under the store root, which may be a shared filesystem.
Workers never open the catalog: the stage's `store.run` in the flow process records
the artifact once every shard is written. Nothing here knows about Prefect or Dask.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from cartridges.core.models import LoadedModel, load_model
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
    key = (ref.spec, ref.device, ref.dtype)
    with _LOCK:
        if key not in _MODELS:
            _MODELS[key] = load_model(ref.spec, ref.device, ref.dtype)
        return _MODELS[key]
