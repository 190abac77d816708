"""Lockstep batched generation behind an optional shared cartridge prefix.

A group of streams is prefilled in one left-padded forward and then decoded with one
forward per step for all streams still running; a stream that stops or reaches its
budget leaves the batch (its cache rows are dropped) so later steps only pay for the
streams that remain. Sampling draws from a per-stream generator, so a stream's tokens
do not depend on which other streams share its batch. The decode step itself lives in
`cartridges.core.batch`, shared with the server.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from cartridges.core.batch import Batch, Running, Stream, looped
from cartridges.core.prefix import Rows, capture_rows
from cartridges.core.sharing import shared_groups

# An answer that repeats a span of this many tokens has started to loop.
LOOP_SPAN = 10


@dataclass
class Generation:
    """What a stream produced; margins let callers tell near-ties from real disagreements."""

    tokens: list[int]
    finished: str  # "stop", "length" or "loop"
    min_margin: float = math.inf
    margins: list[float] = field(default_factory=list)
    topk: list[tuple[list[int], list[float]]] = field(default_factory=list)  # streams with keep_topk
    drafted: int = 0  # draft tokens verified (streams with `draft`)
    accepted: int = 0  # of which greedy decoding chose


def generate(
    model: torch.nn.Module,
    streams: list[Stream],
    batch_size: int = 16,
    prefix_rows: Rows | None = None,
    progress: Callable[[int], None] | None = None,
    share_min: int = 0,
) -> list[Generation]:
    """Continue every stream (groups of `batch_size`, in order); results in input order.

    `share_min > 0`: streams of a group whose prompts start with at least that many
    common tokens prefill them once and continue behind the captured rows.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if share_min and prefix_rows is not None:
        raise ValueError("share_min needs streams without prefix rows (shared rows are captured from position 0)")
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
            for i, gen in zip(idx, _run_group(model, [streams[i] for i in idx], rows, progress, share_min), strict=True):
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
    model: torch.nn.Module, group: Sequence[Stream], rows: Rows, progress: Callable[[int], None] | None,
    share_min: int = 0,
) -> list[Generation]:
    batch = Batch(model)
    if share_min:
        states = _join_shared(model, batch, group, share_min)
    else:
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
            topk=st.topk,
            drafted=st.drafted,
            accepted=st.accepted,
        )
        for st in states
    ]


def _join_shared(model: torch.nn.Module, batch: Batch, group: Sequence[Stream], share_min: int) -> list[Running]:
    """Join each set of streams with a common prompt head behind that head's rows, prefilled once."""
    order: list[int] = []
    joins: list[tuple[list[Stream], Rows | None]] = []
    alone: list[int] = []
    device = next(model.parameters()).device
    # Every stream keeps at least one prompt token of its own: its first choice reads that row.
    for length, members in shared_groups([s.prompt for s in group], share_min, [len(s.prompt) - 1 for s in group]):
        if not length:
            alone += members
            continue
        head = capture_rows(model, torch.tensor(group[members[0]].prompt[:length], device=device))
        joins.append(([replace(group[i], prompt=group[i].prompt[length:]) for i in members], head))
        order += members
    joins.append(([group[i] for i in alone], None))
    states: list[Running | None] = [None] * len(group)
    for i, st in zip(order + alone, batch.join_groups(joins), strict=True):
        states[i] = st
    return states  # type: ignore[return-value]


def loop_start(tokens: list[int], span: int) -> int | None:
    """Index where a repeated `span`-token window first recurs; the same test `loop_span` stops on."""
    seen: set[tuple[int, ...]] = set()
    for end in range(span, len(tokens) + 1):
        if looped(tokens[:end], span, seen):
            return end - span
    return None
