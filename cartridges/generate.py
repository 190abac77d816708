"""Lockstep batched generation behind an optional shared cartridge prefix.

A group of streams is prefilled in one left-padded forward and then decoded with one
forward per step for all streams still running; a stream that stops or reaches its
budget leaves the batch (its cache rows are dropped) so later steps only pay for the
streams that remain. Sampling draws from a per-stream generator, so a stream's tokens
do not depend on which other streams share its batch. The decode step itself lives in
`cartridges.batch`, shared with the server.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from cartridges.batch import Batch, Stream, looped
from cartridges.prefix import Rows


@dataclass
class Generation:
    """What a stream produced; margins let callers tell near-ties from real disagreements."""

    tokens: list[int]
    finished: str  # "stop", "length" or "loop"
    min_margin: float = math.inf
    margins: list[float] = field(default_factory=list)


def generate(
    model: torch.nn.Module,
    streams: list[Stream],
    batch_size: int = 16,
    prefix_rows: Rows | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[Generation]:
    """Continue every stream (groups of `batch_size`, in order); results in input order."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for i, stream in enumerate(streams):
        _check(i, stream)
    rows = list(prefix_rows) if prefix_rows is not None else []
    results: list[Generation | None] = [None] * len(streams)
    todo = []
    for i, stream in enumerate(streams):
        if stream.max_new <= 0:
            results[i] = Generation(tokens=[], finished="length", min_margin=math.inf, margins=[])
        else:
            todo.append(i)
    with torch.no_grad():
        for start in range(0, len(todo), batch_size):
            idx = todo[start : start + batch_size]
            for i, gen in zip(idx, _run_group(model, [streams[i] for i in idx], rows, progress), strict=True):
                results[i] = gen
    return results  # type: ignore[return-value]


def _check(i: int, stream: Stream) -> None:
    if not stream.prompt:
        raise ValueError(f"stream {i}: empty prompt (the first token needs a real position to read from)")
    if stream.temperature < 0 or not math.isfinite(stream.temperature):
        raise ValueError(f"stream {i}: temperature must be a finite number >= 0, got {stream.temperature}")
    if not 0.0 < stream.top_p <= 1.0:
        raise ValueError(f"stream {i}: top_p must be in (0, 1], got {stream.top_p}")


def _run_group(
    model: torch.nn.Module, group: Sequence[Stream], rows: Rows, progress: Callable[[int], None] | None
) -> list[Generation]:
    batch = Batch(model)
    states = batch.join(group, rows)
    while len(batch):
        batch.choose(progress)
        if len(batch):
            batch.advance()
    return [
        Generation(
            tokens=st.tokens,
            finished=st.finished,
            min_margin=min(st.margins, default=math.inf),
            margins=st.margins,
        )
        for st in states
    ]


def loop_start(tokens: list[int], span: int) -> int | None:
    """Index where a repeated `span`-token window first recurs; the same test `loop_span` stops on."""
    seen: set[tuple[int, ...]] = set()
    for end in range(span, len(tokens) + 1):
        if looped(tokens[:end], span, seen):
            return end - span
    return None
