"""Shared prompt heads: prefilled once, every stream and teacher sequence continues as if alone."""

from __future__ import annotations

import pytest
import torch

from cartridges.batch import Stream
from cartridges.generate import generate
from cartridges.sharing import common_length, shared_groups
from cartridges.targets import teacher_targets
from tests.tiny import tiny_llama, tiny_qwen3


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def chunk_major(heads: int = 3, per_head: int = 3, head_len: int = 40) -> list[list[int]]:
    """Prompts in chunk-major order: each head (a chunk) followed by different tails (seeds)."""
    out = []
    for h in range(heads):
        head = ids(head_len + 5 * h, seed=100 + h)
        out += [head + ids(3 + 2 * t, seed=10 * h + t) for t in range(per_head)]
    return out


def test_groups_cover_every_index_once_and_share_only_common_heads():
    seqs = chunk_major() + [ids(30, seed=999)]
    groups = shared_groups(seqs, min_len=16)
    assert sorted(i for _, members in groups for i in members) == list(range(len(seqs)))
    for length, members in groups:
        if length:
            assert len(members) > 1 and length >= 16
            assert all(common_length(seqs[members[0]], seqs[i]) >= length for i in members)
        else:
            assert len(members) == 1
    assert sorted(len(m) for _, m in groups) == [1, 3, 3, 3]


def test_limits_cap_the_shared_head():
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [1, 2, 3, 4, 5, 6]]
    [(length, members)] = shared_groups(seqs, min_len=2, limits=[3, 5, 4])
    assert length == 3 and sorted(members) == [0, 1, 2]
    assert sorted(shared_groups(seqs, min_len=4, limits=[1, 1, 1])) == [(0, [0]), (0, [1]), (0, [2])]


@pytest.mark.parametrize("family", [tiny_llama, tiny_qwen3])
def test_shared_head_generation_equals_each_stream_alone(family):
    lm = family()
    streams = [Stream(p, max_new=6 + i % 4) for i, p in enumerate(chunk_major())]
    alone = [generate(lm.model, [s])[0].tokens for s in streams]
    shared = generate(lm.model, streams, batch_size=len(streams), share_min=16)
    assert [g.tokens for g in shared] == alone


def test_shared_head_sampling_follows_each_streams_own_generator():
    lm = tiny_llama()
    streams = [Stream(p, max_new=8, temperature=0.8, seed=i) for i, p in enumerate(chunk_major())]
    alone = [generate(lm.model, [s])[0].tokens for s in streams]
    assert [g.tokens for g in generate(lm.model, streams, batch_size=5, share_min=16)] == alone


def test_shared_heads_refuse_cartridge_rows():
    lm = tiny_llama()
    with pytest.raises(ValueError, match="share_min"):
        generate(lm.model, [Stream([1, 2, 3], max_new=2)], prefix_rows=[], share_min=4)


def test_teacher_targets_behind_a_shared_head_equal_full_sequences():
    lm = tiny_qwen3()
    seqs = [p + ids(7, seed=500 + i) for i, p in enumerate(chunk_major())]
    starts = [len(s) - 7 for s in seqs]
    full = teacher_targets(lm.model, seqs, starts, k=5, mass=0.999)
    shared = teacher_targets(lm.model, seqs, starts, k=5, mass=0.999, share_min=16)
    for a, b in zip(full, shared, strict=True):
        assert [ids_ for ids_, _ in a] == [ids_ for ids_, _ in b]
        torch.testing.assert_close(torch.tensor([lp for _, lp in a]), torch.tensor([lp for _, lp in b]),
                                   atol=1e-5, rtol=1e-5)
