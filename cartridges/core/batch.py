"""A running lockstep batch: streams join behind their own prefix rows, decode together, leave.

This is the one decode-step implementation. `generate` fills a batch once and runs it
dry; the server keeps one batch running and lets requests join and leave between steps.

Layout: one cache `[B, H, T, d]` per layer shared by all running streams. A stream
that joins is prefilled (left-padded, behind its prefix rows) and its rows are placed
right-aligned in the batch, so every decode step writes the same column for all
streams; columns a stream may not read (another stream's padding) are masked, and
positions are per stream (its own prefix length plus its tokens so far). Streams may
sit behind different prefixes of different lengths.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from cartridges.core.drafts import Drafter
from cartridges.core.models import cache_keyword, project, read_cache
from cartridges.core.prefix import Rows, attention_masks, forward_behind, prefix_length
from cartridges.core.targets import top_entries


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
    keep_topk: int = 0  # > 0: keep each step's top-k log-probabilities (the teacher's targets, for free)
    draft: int = 0  # > 0 (greedy only): verify up to this many prompt-lookup tokens per step
    draft_reference: Sequence[int] = ()  # further text drafts may come from (a cartridge's corpus)


@dataclass
class Running:
    """A stream's state inside a batch; `finished` is set when it leaves."""

    stream: Stream
    tag: Any = None
    tokens: list[int] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    topk: list[tuple[list[int], list[float]]] = field(default_factory=list)  # with keep_topk: per token
    finished: str = ""  # "", or "stop", "length", "loop"
    prefix_rows: int = 0
    keep_kv: bool = False
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # with keep_kv: its rows when it left
    generator: torch.Generator | None = field(default=None, repr=False)
    windows: set[tuple[int, ...]] = field(default_factory=set, repr=False)
    drafter: Drafter | None = field(default=None, repr=False)
    new: int = 0  # tokens the last `choose` appended (more than one when drafts were accepted)
    drafted: int = 0  # draft tokens verified so far
    accepted: int = 0  # of which greedy decoding chose


@dataclass
class _Prefilled:
    """One group's prefill: its prefix length, cache rows, first logits, readable columns, next positions."""

    p: int
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    logits: torch.Tensor
    allowed: torch.Tensor
    positions: torch.Tensor


class Batch:
    """Streams decoding in lockstep: one forward per step for all of them.

    Every running stream has pending logits between steps: `join` prefills new streams
    (their first choice comes from the prefill), `choose` picks a token for every stream
    and retires the finished ones, `advance` runs one decode forward for the rest.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.keyword = cache_keyword(model)
        self.states: list[Running] = []
        self.cache: BatchCache | None = None
        self.allowed = torch.zeros(0, 0, dtype=torch.bool, device=self.device)  # [B, T] readable columns
        self.positions = torch.zeros(0, dtype=torch.long, device=self.device)  # [B] next position
        self.logits: torch.Tensor | None = None  # [B, vocab] pending choice; [B, 1 + drafts, vocab] after drafts
        self.fed: list[list[int]] = []  # per stream, the draft tokens the pending logits verify

    def __len__(self) -> int:
        return len(self.states)

    @property
    def width(self) -> int:
        return int(self.allowed.shape[1])

    def join(
        self, streams: Sequence[Stream], prefix_rows: Rows | None = None, tags: Sequence[Any] | None = None,
        keep_kv: bool = False,
    ) -> list[Running]:
        """Prefill `streams` behind one shared prefix in one left-padded forward and add them."""
        return self.join_groups([(streams, prefix_rows)], tags, keep_kv)

    def join_groups(
        self, groups: Sequence[tuple[Sequence[Stream], Rows | None]], tags: Sequence[Any] | None = None,
        keep_kv: bool = False,
    ) -> list[Running]:
        """Prefill each group of streams behind its own prefix (one forward per group) and add them
        all, in order. The batch's cache is rebuilt once for every group, not once per group."""
        groups = [(list(streams), rows) for streams, rows in groups if streams]
        if not groups:
            return []
        streams = [s for members, _ in groups for s in members]
        tags = list(tags) if tags is not None else [None] * len(streams)
        parts = [self._prefill(members, rows) for members, rows in groups]
        prefixes = [part.p for part, (members, _) in zip(parts, groups, strict=True) for _ in members]
        new = [
            Running(stream=s, tag=t, prefix_rows=p, keep_kv=keep_kv, generator=_generator(s, self.device),
                    drafter=_drafter(s))
            for s, t, p in zip(streams, tags, prefixes, strict=True)
        ]
        # Room for every token any stream may still write, so steps never regrow the cache.
        room = max(s.max_new for s in streams) - 1
        room = max([room] + [st.stream.max_new - len(st.tokens) for st in self.states])
        running = self.cache is not None and bool(self.states)
        layers = [part.layers for part in parts]
        if running:
            assert self.cache is not None and self.logits is not None, "join between choose and advance"
            self.cache.extend(layers, room)
        else:
            self.cache = BatchCache(layers, room)
        total = self.cache.length
        allowed = torch.cat([_pad_left(part.allowed, total) for part in parts])
        positions = torch.cat([part.positions for part in parts])
        logits = torch.cat([part.logits for part in parts])
        if not running:
            self.allowed, self.positions, self.logits, self.fed = allowed, positions, logits, []
        else:
            self.allowed = torch.cat([_pad_left(self.allowed, total), allowed])
            self.positions = torch.cat([self.positions, positions])
            if self.logits.dim() == 3:  # the running streams verify drafts; the new ones have one row
                logits = torch.cat([logits[:, None], logits.new_zeros(len(streams), self.logits.shape[1] - 1,
                                                                      logits.shape[-1])], dim=1)
            self.logits = torch.cat([self.logits, logits])
        self.fed += [[] for _ in streams]
        self.states += new
        return new

    def _prefill(self, streams: list[Stream], prefix_rows: Rows | None) -> _Prefilled:
        rows = list(prefix_rows) if prefix_rows is not None else []
        p = prefix_length(rows)
        lengths = [len(s.prompt) for s in streams]
        width = max(lengths)
        ids = torch.zeros(len(streams), width, dtype=torch.long)
        real = torch.zeros(len(streams), width, dtype=torch.bool)
        for r, stream in enumerate(streams):
            ids[r, width - lengths[r] :] = torch.tensor(stream.prompt, dtype=torch.long)
            real[r, width - lengths[r] :] = True
        ids, real = ids.to(self.device), real.to(self.device)
        with torch.no_grad():
            hidden, filled = forward_behind(self.model, rows, ids, attention_mask=real.long(), use_cache=True)
            # Only the last row of each stream is projected: [B, L, vocab] is never built.
            logits = project(self.model, hidden[:, -1])
        del hidden
        allowed = torch.cat([torch.ones(len(streams), p, dtype=torch.bool, device=self.device), real], dim=1)
        positions = torch.tensor([p + n for n in lengths], dtype=torch.long, device=self.device)
        return _Prefilled(p, read_cache(filled), logits, allowed, positions)

    def choose(self, progress: Callable[[int], None] | None = None) -> list[Running]:
        """Pick the next token of every stream, and every accepted draft token after it; finished
        streams leave. Returns all streams stepped (`new` says how many tokens each took)."""
        if self.logits is None:
            raise RuntimeError("choose needs pending logits (join or advance first)")
        logits = self.logits if self.logits.dim() == 3 else self.logits[:, None]
        streams = [s.stream for s in self.states]
        chosen, margins = _choose(logits[:, 0], streams, [s.generator for s in self.states])
        later = _top2(logits[:, 1:]) if logits.shape[1] > 1 else None  # greedy choices after each draft token
        kept = self._top_entries(logits)
        self.logits = None
        keep, width = [], logits.shape[1]
        for r, st in enumerate(self.states):
            fed, taken = self.fed[r], 0
            token, margin = chosen[r], margins[r]
            st.new = 0
            while True:
                st.tokens.append(token)
                st.margins.append(margin)
                st.new += 1
                if kept is not None and st.stream.keep_topk:
                    ids_, values_ = kept[r][taken]
                    st.topk.append((ids_[: st.stream.keep_topk], values_[: st.stream.keep_topk]))
                st.finished = self._finished(st, token)
                if st.finished or taken >= len(fed) or token != fed[taken]:
                    break
                taken += 1
                assert later is not None
                token, margin = later[0][r][taken - 1], later[1][r][taken - 1]
            if st.drafter is not None:
                st.drafter.extend(st.tokens[-st.new :])
                st.drafter.record(len(fed), taken, len(st.tokens))
            st.drafted += len(fed)
            st.accepted += taken
            if fed and taken < len(fed):  # rejected drafts' columns: never read again
                end = self.allowed.shape[1] - width + 1 + len(fed)
                self.allowed[r, end - (len(fed) - taken) : end] = False
            self.positions[r] += taken
            if not st.finished:
                keep.append(r)
        if width > 1:
            self._trim_unread_tail()
        stepped = list(self.states)
        if progress is not None:
            progress(sum(st.new for st in stepped))
        self._keep(keep)
        self.fed = [[] for _ in self.states]
        return stepped

    def _trim_unread_tail(self) -> None:
        """Give back trailing columns no stream reads (drafts every stream rejected)."""
        assert self.cache is not None
        read = self.allowed.any(0)
        tail = int(read.flip(0).long().argmax().item()) if bool(read.any()) else 0
        if tail > 0:
            self.cache.trim_tail(tail)
            self.allowed = self.allowed[:, :-tail]

    def _finished(self, st: Running, token: int) -> str:
        span = st.stream.loop_span
        if token in st.stream.stop_ids:
            return "stop"
        if span and looped(st.tokens, span, st.windows):
            return "loop"
        if len(st.tokens) >= st.stream.max_new:
            return "length"
        return ""

    def _top_entries(self, logits: torch.Tensor) -> dict[int, list] | None:
        """Per stream that keeps them, every row's top entries (the distribution each token came from)."""
        want = [r for r, st in enumerate(self.states) if st.stream.keep_topk]
        if not want:
            return None
        k = max(self.states[r].stream.keep_topk for r in want)
        rows = torch.tensor(want, device=logits.device)
        values, ids = top_entries(logits.index_select(0, rows), k)
        return {r: list(zip(i, v, strict=True)) for r, i, v in zip(want, ids.tolist(), values.tolist(), strict=True)}

    def drop(self, tags: Sequence[Any]) -> list[Running]:
        """Remove streams by tag (a client went away); returns the removed ones."""
        gone = {id(t) for t in tags}
        removed = [st for st in self.states if id(st.tag) in gone]
        if removed:
            self._keep([r for r, st in enumerate(self.states) if id(st.tag) not in gone])
        return removed

    def advance(self) -> None:
        """One decode forward for every running stream: its last token in, pending logits out.

        Greedy streams that draft (`Stream.draft`) also feed their drafted tokens; the
        logits after each are what `choose` verifies them against.
        """
        if not self.states or self.cache is None:
            return
        drafts = [st.drafter.propose(len(st.tokens)) if st.drafter is not None else [] for st in self.states]
        # The step itself chooses one token: drafts beyond the budget's last token are never used.
        drafts = [d[: st.stream.max_new - len(st.tokens) - 1] for d, st in zip(drafts, self.states, strict=True)]
        width = 1 + max(len(d) for d in drafts)
        batch = len(self.states)
        ids = torch.zeros(batch, width, dtype=torch.long)
        fed = torch.zeros(batch, width, dtype=torch.bool)
        for r, (st, d) in enumerate(zip(self.states, drafts, strict=True)):
            ids[r, : 1 + len(d)] = torch.tensor([st.tokens[-1], *d], dtype=torch.long)
            fed[r, : 1 + len(d)] = True
        ids, fed = ids.to(self.device), fed.to(self.device)
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        allowed = torch.cat([self.allowed[:, None, :].expand(batch, width, -1), fed[:, None, :] & causal], dim=-1)
        mask = attention_masks(self.model, allowed, self.dtype)
        with torch.no_grad():
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=self.positions[:, None] + torch.arange(width, device=self.device),
                use_cache=True,
                **{self.keyword: self.cache},
            )
        self.allowed = torch.cat([self.allowed, fed], dim=1)
        self.logits = out.logits[:, -1] if width == 1 else out.logits
        self.fed = drafts
        self.positions = self.positions + 1

    def kv_bytes(self) -> int:
        """Bytes of cache columns the running streams can read (padding excluded)."""
        if self.cache is None or not self.states:
            return 0
        per_column = sum(k.shape[1] * k.shape[3] * k.element_size() + v.shape[1] * v.shape[3] * v.element_size()
                         for k, v in self.cache.views())
        return int(self.allowed.sum().item()) * per_column

    def _keep(self, keep: list[int]) -> None:
        if len(keep) == len(self.states):
            return
        for r, st in enumerate(self.states):
            if st.keep_kv and r not in keep:
                st.kv = self._row_kv(r)
        if not keep:
            self.states, self.fed = [], []
            self.cache = None
            self.allowed = self.allowed[:0, :0]
            self.positions = self.positions[:0]
            self.logits = None
            return
        assert self.cache is not None
        order = self.cache.compact(keep)
        self.states = [self.states[r] for r in order]
        self.fed = [self.fed[r] for r in order]
        index = torch.tensor(order, dtype=torch.long, device=self.device)
        self.allowed = self.allowed.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        if self.logits is not None:
            self.logits = self.logits.index_select(0, index)
        # Columns no remaining stream reads (padding of streams that left) are cut off.
        unread = int(self.allowed.any(0).long().argmax().item())
        if unread > 0:
            self.cache.trim(unread)
            self.allowed = self.allowed[:, unread:]

    def _row_kv(self, r: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One stream's readable rows, per layer `[H, n, d]`: prefix, prompt and tokens fed so far."""
        assert self.cache is not None
        cols = self.allowed[r].nonzero().squeeze(1)
        return [(k[r].index_select(1, cols).clone(), v[r].index_select(1, cols).clone()) for k, v in self.cache.views()]


def _pad_left(allowed: torch.Tensor, width: int) -> torch.Tensor:
    extra = width - allowed.shape[1]
    if extra <= 0:
        return allowed
    return torch.cat([allowed.new_zeros(allowed.shape[0], extra), allowed], dim=1)


class BatchCache(DynamicCache):
    """A cache with spare columns: a decode step writes one column in place.

    The default cache concatenates, which copies the whole cache (as large as the weights
    for wide batches) on every step. Streams joining are placed right-aligned (zeros in
    the columns they do not have), streams leaving are dropped, and columns nobody reads
    any more are trimmed from the left.
    """

    def __init__(self, groups: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]], room: int) -> None:
        self._full, n = _right_aligned(groups, room)
        super().__init__(ddp_cache_data=[(k[..., :n, :], v[..., :n, :]) for k, v in self._full])
        self._set(n)

    @property
    def length(self) -> int:
        return int(self.layers[0].keys.shape[-2])

    def views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in self.layers]

    def _set(self, n: int) -> None:
        for layer, (k, v) in zip(self.layers, self._full, strict=True):
            layer.keys, layer.values = k[..., :n, :], v[..., :n, :]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        k, v = self._full[layer_idx]
        n, q = layer.keys.shape[-2], key_states.shape[-2]
        if n + q > k.shape[-2]:
            grow = max(64, n // 4) + q
            k, v = _with_room(k[..., :n, :], grow), _with_room(v[..., :n, :], grow)
            self._full[layer_idx] = (k, v)
        k[..., n : n + q, :] = key_states
        v[..., n : n + q, :] = value_states
        layer.keys, layer.values = k[..., : n + q, :], v[..., : n + q, :]
        return layer.keys, layer.values

    def extend(self, groups: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]], room: int) -> None:
        """Append streams (rows of other caches, group by group), right-aligned with the running ones."""
        self._full, n = _right_aligned([self.views(), *groups], room)
        self._set(n)

    def compact(self, keep: list[int]) -> list[int]:
        """Physically drop the rows not in `keep` (ascending) so later steps skip them; returns
        the old row index of each row now, in order. The last kept rows move into the gaps, so
        a stream's retirement copies one row of the cache, not every running stream's rows."""
        m, kept, n = len(keep), set(keep), self.length
        order = list(range(m))
        for hole, row in zip((r for r in range(m) if r not in kept), (r for r in keep if r >= m), strict=True):
            order[hole] = row
            for k, v in self._full:
                k[hole], v[hole] = k[row], v[row]
        self._full = [(k[:m], v[:m]) for k, v in self._full]
        self._set(n)
        return order

    def trim_tail(self, columns: int) -> None:
        """Forget the last `columns` columns; later steps write over them."""
        self._set(self.length - columns)

    def trim(self, columns: int) -> None:
        """Forget the first `columns` columns (no running stream reads them)."""
        n = self.length
        self._full = [(k[..., columns:, :], v[..., columns:, :]) for k, v in self._full]
        self._set(n - columns)


def _right_aligned(
    groups: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]], room: int,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """Every group's rows (per layer `[B, H, T, d]`) in one buffer per layer, right-aligned at the
    longest group's length `n` with `room` free columns after it; returns the buffers and `n`. The
    columns left of a shorter group's rows are zero: never read, but kept finite."""
    n = max(group[0][0].shape[-2] for group in groups)
    batch = sum(group[0][0].shape[0] for group in groups)
    full = []
    for layer in range(len(groups[0])):
        pair = []
        for side in range(2):
            first = groups[0][layer][side]
            t = first.new_empty(batch, first.shape[1], n + max(room, 0), first.shape[3])
            row = 0
            for group in groups:
                part = group[layer][side]
                b, m = part.shape[0], part.shape[-2]
                t[row : row + b, :, : n - m].zero_()
                t[row : row + b, :, n - m : n] = part
                row += b
            pair.append(t)
        full.append((pair[0], pair[1]))
    return full, n


def _with_room(t: torch.Tensor, room: int) -> torch.Tensor:
    n = t.shape[-2]
    out = t.new_empty(*t.shape[:-2], n + max(room, 0), t.shape[-1])
    out[..., :n, :] = t
    return out


def looped(tokens: list[int], span: int, seen: set[tuple[int, ...]]) -> bool:
    """Whether the newest `span`-token window already occurred (a greedy decoding loop)."""
    if len(tokens) < span:
        return False
    window = tuple(tokens[-span:])
    if window in seen:
        return True
    seen.add(window)
    return False


def _drafter(stream: Stream) -> Drafter | None:
    if stream.draft <= 0 or stream.temperature > 0:
        return None
    return Drafter(stream.draft_reference, stream.prompt, stream.draft)


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
    chosen, margins = _top2(logits)
    for r, (stream, gen) in enumerate(zip(streams, generators, strict=True)):
        if gen is not None:
            chosen[r] = _sample(logits[r], stream.temperature, stream.top_p, gen)
    return chosen, margins


def _top2(logits: torch.Tensor) -> tuple[list, list]:
    """Greedy ids and top-2 margins over the last dimension (nested lists of the leading ones)."""
    values, ids = logits.to(torch.promote_types(logits.dtype, torch.float32)).topk(2, dim=-1)
    return ids[..., 0].tolist(), (values[..., 0] - values[..., 1]).tolist()


def _sample(row: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    work = row.to(torch.promote_types(row.dtype, torch.float32))
    # Shifted to a maximum of 0 and kept off a zero divisor: a temperature so small that the
    # logits overflow (or that rounds to 0 in float32) still gives a distribution, not NaNs.
    work = (work - work.max()) / max(temperature, torch.finfo(work.dtype).tiny)
    probs = torch.softmax(work, dim=-1)
    if top_p >= 1.0:
        return int(torch.multinomial(probs, 1, generator=gen).item())
    sorted_probs, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    pick = int(torch.multinomial(sorted_probs, 1, generator=gen).item())
    return int(order[pick].item())
