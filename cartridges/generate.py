"""Lockstep batched generation behind an optional shared cartridge prefix.

A group of streams is prefilled in one left-padded forward and then decoded with one
forward per step for all streams still running; a stream that stops or reaches its
budget leaves the batch (its cache rows are dropped) so later steps only pay for the
streams that remain. Sampling draws from a per-stream generator, so a stream's tokens
do not depend on which other streams share its batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from cartridges.models import cache_keyword, project
from cartridges.prefix import Rows, forward_behind, prefix_length, read_cache


@dataclass
class Stream:
    """One conversation to continue; `prompt` is already chat-rendered token ids."""

    prompt: list[int]
    max_new: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    loop_span: int = 0  # > 0: end the stream once a window of this many tokens recurs


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
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    p = prefix_length(rows)
    batch = len(group)
    lengths = [len(s.prompt) for s in group]
    width = max(lengths)

    ids = torch.zeros(batch, width, dtype=torch.long)
    real = torch.zeros(batch, width, dtype=torch.bool)
    for r, stream in enumerate(group):
        ids[r, width - lengths[r] :] = torch.tensor(stream.prompt, dtype=torch.long)
        real[r, width - lengths[r] :] = True
    ids, real = ids.to(device), real.to(device)

    hidden, filled = forward_behind(model, rows, ids, attention_mask=real.long(), use_cache=True)
    # Only the last row of each stream is projected: [B, L, vocab] is never built.
    logits = project(model, hidden[:, -1])
    del hidden
    cache = _RoomyCache(filled, room=max(s.max_new for s in group) - 1)
    del filled

    # Key columns each stream may read: all prefix rows and its own real tokens.
    allowed = torch.cat([torch.ones(batch, p, dtype=torch.bool, device=device), real], dim=1)
    positions = torch.tensor([p + n for n in lengths], dtype=torch.long, device=device)
    keyword = cache_keyword(model)
    generators = [_generator(s, device) for s in group]
    tokens: list[list[int]] = [[] for _ in group]
    margins: list[list[float]] = [[] for _ in group]
    finished = [""] * batch
    active = list(range(batch))
    windows: list[set[tuple[int, ...]]] = [set() for _ in group]

    while True:
        chosen, step_margins = _choose(logits, [group[i] for i in active], [generators[i] for i in active])
        keep = []
        for r, i in enumerate(active):
            token = chosen[r]
            tokens[i].append(token)
            margins[i].append(step_margins[r])
            span = group[i].loop_span
            if token in group[i].stop_ids:
                finished[i] = "stop"
            elif span and _looped(tokens[i], span, windows[i]):
                finished[i] = "loop"
            elif len(tokens[i]) >= group[i].max_new:
                finished[i] = "length"
            else:
                keep.append(r)
        if progress is not None:
            progress(len(active))
        if not keep:
            break
        if len(keep) < len(active):
            rows_kept = torch.tensor(keep, dtype=torch.long, device=device)
            cache.select_rows(rows_kept)
            allowed = allowed.index_select(0, rows_kept)
            positions = positions.index_select(0, rows_kept)
            active = [active[r] for r in keep]
        last = torch.tensor([tokens[i][-1] for i in active], dtype=torch.long, device=device)
        allowed = torch.cat([allowed, allowed.new_ones(len(active), 1)], dim=1)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        out = model(
            input_ids=last[:, None],
            attention_mask=mask[:, None, None, :],
            position_ids=positions[:, None],
            use_cache=True,
            **{keyword: cache},
        )
        logits = out.logits[:, -1]
        positions = positions + 1

    return [
        Generation(
            tokens=tokens[i],
            finished=finished[i],
            min_margin=min(margins[i], default=math.inf),
            margins=margins[i],
        )
        for i in range(batch)
    ]


def _looped(tokens: list[int], span: int, seen: set[tuple[int, ...]]) -> bool:
    """Whether the newest `span`-token window already occurred (a greedy decoding loop)."""
    if len(tokens) < span:
        return False
    window = tuple(tokens[-span:])
    if window in seen:
        return True
    seen.add(window)
    return False


def loop_start(tokens: list[int], span: int) -> int | None:
    """Index where a repeated `span`-token window first recurs; the same test `loop_span` stops on."""
    seen: set[tuple[int, ...]] = set()
    for end in range(span, len(tokens) + 1):
        if _looped(tokens[:end], span, seen):
            return end - span
    return None


def _generator(stream: Stream, device: torch.device) -> torch.Generator | None:
    if stream.temperature <= 0:
        return None
    return torch.Generator(device=device).manual_seed(stream.seed)


def _choose(
    logits: torch.Tensor, streams: Sequence[Stream], generators: Sequence[torch.Generator | None]
) -> tuple[list[int], list[float]]:
    """Next token and top-2 margin per row from one pass over the vocabulary.

    Greedy rows take the top-1 id; sampled rows draw one by one from their own
    generator so each draw depends only on that stream.
    """
    if logits.shape[-1] < 2:
        return [0] * logits.shape[0], [math.inf] * logits.shape[0]
    values, ids = logits.to(torch.promote_types(logits.dtype, torch.float32)).topk(2, dim=-1)
    chosen = ids[:, 0].tolist()
    margins = (values[:, 0] - values[:, 1]).tolist()
    for r, (stream, gen) in enumerate(zip(streams, generators, strict=True)):
        if gen is not None:
            chosen[r] = _sample(logits[r], stream.temperature, stream.top_p, gen)
    return chosen, margins


def _sample(row: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    work = row.to(torch.promote_types(row.dtype, torch.float32)) / temperature
    probs = torch.softmax(work, dim=-1)
    if top_p >= 1.0:
        return int(torch.multinomial(probs, 1, generator=gen).item())
    sorted_probs, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    pick = int(torch.multinomial(sorted_probs, 1, generator=gen).item())
    return int(order[pick].item())


class _RoomyCache(DynamicCache):
    """A cache whose layers have spare columns for the tokens still to come.

    A decode step then writes one column in place; the default cache concatenates, which
    copies the whole cache (as large as the weights for wide batches) on every step.
    """

    def __init__(self, filled: DynamicCache, room: int):
        self._full: list[tuple[torch.Tensor, torch.Tensor]] = []
        views = []
        for keys, values in read_cache(filled):
            n = keys.shape[-2]
            k = keys.new_empty(*keys.shape[:-2], n + room, keys.shape[-1])
            v = values.new_empty(*values.shape[:-2], n + room, values.shape[-1])
            k[..., :n, :] = keys
            v[..., :n, :] = values
            self._full.append((k, v))
            views.append((k[..., :n, :], v[..., :n, :]))
        super().__init__(ddp_cache_data=views)
        for layer, (k, v) in zip(self.layers, views, strict=True):
            layer.keys, layer.values = k, v

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        k, v = self._full[layer_idx]
        n, q = layer.keys.shape[-2], key_states.shape[-2]
        k[..., n : n + q, :] = key_states
        v[..., n : n + q, :] = value_states
        layer.keys, layer.values = k[..., : n + q, :], v[..., : n + q, :]
        return layer.keys, layer.values

    def select_rows(self, rows: torch.Tensor) -> None:
        """Physically drop retired streams so later steps skip their rows."""
        for i, layer in enumerate(self.layers):
            n = layer.keys.shape[-2]
            k, v = (t.index_select(0, rows) for t in self._full[i])
            self._full[i] = (k, v)
            layer.keys, layer.values = k[..., :n, :], v[..., :n, :]
