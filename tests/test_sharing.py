"""Shared prompt heads: prefilled once, every stream and teacher sequence continues as if alone."""

from __future__ import annotations

import pytest
import torch

from cartridges.core.batch import Stream
from cartridges.core.generate import generate
from cartridges.core.sharing import common_length, shared_groups
from cartridges.core.targets import teacher_targets
from tests.tiny import tiny_gemma3, tiny_llama, tiny_qwen3


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


@pytest.mark.parametrize("family", [tiny_llama, tiny_gemma3])
def test_kept_topk_are_the_teacher_targets(family):
    """What bot B keeps while it decodes (shared heads, one wide batch) is what the teacher
    pass computes by running prompt plus answer again."""
    lm = family()
    streams = [Stream(p, max_new=5 + i % 3, keep_topk=8) for i, p in enumerate(chunk_major())]
    out = generate(lm.model, streams, batch_size=len(streams), share_min=16)
    full = [s.prompt + g.tokens for s, g in zip(streams, out, strict=True)]
    reference = teacher_targets(lm.model, full, [len(s.prompt) for s in streams], k=8, mass=1.0)
    for g, ref in zip(out, reference, strict=True):
        assert len(g.topk) == len(g.tokens) == len(ref)
        for (ids_kept, lp_kept), (ids_ref, lp_ref) in zip(g.topk, ref, strict=True):
            assert ids_kept[0] == ids_ref[0]
            torch.testing.assert_close(torch.tensor(lp_kept), torch.tensor(lp_ref[: len(lp_kept)]),
                                       atol=1e-4, rtol=1e-4)


def test_teacher_stage_reads_kept_targets_and_cuts_them_like_the_forward():
    from schemas import TeacherConfig
    from stages.teacher import target_rows

    lm = tiny_llama()
    streams = [Stream(p, max_new=6, keep_topk=20) for p in chunk_major(heads=2, per_head=2)]
    out = generate(lm.model, streams, batch_size=len(streams), share_min=16)
    convs = []
    for i, (s, g) in enumerate(zip(streams, out, strict=True)):
        conv = {"conv_id": i, "teacher_ids": s.prompt + g.tokens, "answer_start": len(s.prompt),
                "student_answer_start": len(s.prompt) - 10}
        convs.append({**conv, "answer_topk_ids": [t for t, _ in g.topk],
                      "answer_topk_logprobs": [lp for _, lp in g.topk]})
        convs.append({**conv, "conv_id": 100 + i})  # nothing kept: computed by a forward
    config = TeacherConfig(top_k=5, top_mass=0.9)
    rows = target_rows(lm, convs, config)
    by_conv: dict[int, list] = {}
    for r in rows:
        by_conv.setdefault(r["conv_id"], []).append(r)
    for i in range(len(streams)):
        kept, computed = by_conv[i], by_conv[100 + i]
        assert [r["position"] for r in kept] == [r["position"] for r in computed]
        for a, b in zip(kept, computed, strict=True):
            assert a["topk_ids"] == b["topk_ids"] and len(a["topk_ids"]) <= 5
            torch.testing.assert_close(torch.tensor(a["topk_logprobs"]), torch.tensor(b["topk_logprobs"]),
                                       atol=1e-4, rtol=1e-4)
