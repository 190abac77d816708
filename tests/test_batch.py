"""A running batch that streams join and leave, each behind its own prefix, against each stream alone."""

from __future__ import annotations

import pytest
import torch

from cartridges.core.batch import Batch, BatchCache, Stream
from cartridges.core.generate import generate
from cartridges.core.prefix import capture_rows
from tests.tiny import TINY, tiny_llama


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("grouped", [False, True], ids=["join", "join_groups"])
@pytest.mark.parametrize("family", sorted(TINY))
def test_streams_joining_mid_run_behind_different_prefixes_equal_each_alone(family, grouped):
    lm = TINY[family](torch.float64)
    prefixes = [None, capture_rows(lm.model, torch.tensor(ids(8, 90))), capture_rows(lm.model, torch.tensor(ids(3, 91)))]
    # (prefix, prompt length, budget, step at which it joins)
    plan = [(1, 5, 12, 0), (0, 9, 6, 0), (2, 2, 10, 2), (1, 14, 8, 3), (0, 1, 5, 7), (2, 7, 9, 7)]
    streams = [Stream(ids(n, seed=i), max_new=m) for i, (_, n, m, _) in enumerate(plan)]
    batch = Batch(lm.model)
    done: dict[int, list[int]] = {}
    widths = []
    step = 0
    while len(done) < len(plan):
        by_prefix: dict[int, list[int]] = {}
        for i, (pref, _, _, at) in enumerate(plan):
            if at == step:
                by_prefix.setdefault(pref, []).append(i)
        if grouped:  # every prefix's streams of this step in one call, the cache rebuilt once
            batch.join_groups([([streams[i] for i in members], prefixes[pref]) for pref, members in by_prefix.items()],
                              tags=[i for members in by_prefix.values() for i in members])
        for pref, members in ([] if grouped else by_prefix.items()):
            batch.join([streams[i] for i in members], prefixes[pref], tags=members)
        widths.append(len(batch))
        for st in batch.choose():
            if st.finished:
                done[st.tag] = st.tokens
        if len(batch):
            batch.advance()
        step += 1
    assert max(widths) >= 4  # streams really overlapped
    for i, (pref, _, _, _) in enumerate(plan):
        alone = generate(lm.model, [streams[i]], batch_size=1, prefix_rows=prefixes[pref])[0]
        assert done[i] == alone.tokens, f"stream {i}"


def test_compacting_moves_the_last_kept_rows_into_the_gaps():
    layers = [(torch.randn(5, 2, 3, 4), torch.randn(5, 2, 3, 4)) for _ in range(2)]
    before = [(k.clone(), v.clone()) for k, v in layers]
    cache = BatchCache([layers], room=2)
    order = cache.compact([0, 2, 4])
    assert order == [0, 4, 2]  # row 4 fills the gap at 1; rows 0 and 2 stay where they are
    index = torch.tensor(order)
    for (k, v), (k0, v0) in zip(cache.views(), before, strict=True):
        assert torch.equal(k, k0.index_select(0, index)) and torch.equal(v, v0.index_select(0, index))


def test_groups_of_different_lengths_are_right_aligned_behind_zeros():
    short = [(torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4))]
    long = [(torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4))]
    cache = BatchCache([short, long], room=4)
    (k, v), = cache.views()
    assert cache.length == 5 and k.shape == (3, 1, 5, 4)
    assert torch.equal(k[:2, :, 2:], short[0][0]) and torch.equal(v[2:], long[0][1])
    assert not k[:2, :, :2].any() and not v[:2, :, :2].any()


def test_dropped_streams_leave_and_the_rest_continue_unchanged():
    lm = tiny_llama(torch.float64)
    streams = [Stream(ids(n, seed=i), max_new=10) for i, n in enumerate((4, 12, 7))]
    batch = Batch(lm.model)
    batch.join(streams, tags=[0, 1, 2])
    got: dict[int, list[int]] = {}
    for step in range(10):
        if step == 3:
            assert [st.tag for st in batch.drop([1])] == [1]
        for st in batch.choose():
            got[st.tag] = st.tokens
        if len(batch):
            batch.advance()
    assert len(batch) == 0 and batch.cache is None
    assert len(got[1]) == 3
    for i in (0, 2):
        assert got[i] == generate(lm.model, [streams[i]], batch_size=1)[0].tokens


def test_kept_kv_continues_a_conversation_like_the_full_prompt():
    """The seam for follow-up turns: a finished stream's rows stand in for its whole history."""
    lm = tiny_llama(torch.float64)
    head = capture_rows(lm.model, torch.tensor(ids(6, 50)))
    first = Stream(ids(5, seed=1), max_new=7)
    batch = Batch(lm.model)
    (state,) = batch.join([first], head, keep_kv=True)
    while len(batch):
        batch.choose()
        if len(batch):
            batch.advance()
    assert state.kv is not None and state.kv[0][0].shape[1] == 6 + 5 + 7 - 1
    follow = ids(4, seed=2)
    behind_kv = generate(lm.model, [Stream(state.tokens[-1:] + follow, max_new=6)], prefix_rows=state.kv)[0]
    full = generate(lm.model, [Stream(first.prompt + state.tokens + follow, max_new=6)], prefix_rows=head)[0]
    assert behind_kv.tokens == full.tokens
    assert behind_kv.margins == pytest.approx(full.margins, abs=1e-9)
