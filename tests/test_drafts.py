"""Speculative greedy decoding from prompt lookup: the same tokens as plain decoding, fewer steps."""

from __future__ import annotations

import pytest
import torch

from cartridges.core.batch import Batch, Stream
from cartridges.core.drafts import MIN_ACCEPT, REPROBE, WINDOW, Drafter
from cartridges.core.generate import generate
from tests.tiny import tiny_gemma3, tiny_llama


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_drafter_proposes_what_followed_the_latest_earlier_match():
    d = Drafter(reference=[9, 1, 2, 3, 4], prompt=[5, 1, 2, 7, 8, 1, 2], width=3)
    assert d.propose(0) == [7, 8, 1]  # "1 2" last seen before the tail at 1 2 -> 7 8 1
    d.extend([7])
    assert d.propose(1) == [8, 1, 2]  # "1 2 7" (three tokens) wins over shorter matches
    assert Drafter([], [1, 2, 3], width=4).propose(0) == []  # nothing seen twice


def test_gate_pauses_drafting_below_the_acceptance_floor_and_probes_again():
    d = Drafter([], [1, 2, 1, 2], width=4)
    assert d.propose(0)
    rejected = int(WINDOW * MIN_ACCEPT) - 1
    d.record(WINDOW, rejected, generated=10)
    assert d.propose(11) == [] and d.propose(10 + REPROBE - 1) == []
    assert d.propose(10 + REPROBE)  # probing again
    d.record(WINDOW, WINDOW, generated=50)
    assert d.propose(51)


def repetitive_prompts(n: int) -> list[list[int]]:
    """Prompts that repeat a phrase, so lookups find something to draft."""
    out = []
    for i in range(n):
        phrase = ids(6, seed=50 + i)
        out.append(ids(5 + i, seed=i) + phrase + ids(4, seed=90 + i) + phrase + phrase[:2])
    return out


@pytest.mark.parametrize("family", [tiny_llama, tiny_gemma3])
def test_drafted_decoding_gives_the_tokens_of_plain_decoding(family):
    lm = family()
    prompts = repetitive_prompts(6)
    plain = [Stream(p, max_new=24 + 3 * i, keep_topk=5) for i, p in enumerate(prompts)]
    # a sampled stream in the same batch keeps its own draws (it never drafts)
    plain.append(Stream(prompts[0], max_new=20, temperature=0.9, seed=3))
    drafted = [Stream(s.prompt, s.max_new, s.temperature, seed=s.seed, keep_topk=s.keep_topk, draft=4)
               for s in plain]
    base = generate(lm.model, plain, batch_size=len(plain))
    spec = generate(lm.model, drafted, batch_size=len(drafted))
    assert [g.tokens for g in spec] == [g.tokens for g in base]
    assert [g.finished for g in spec] == [g.finished for g in base]
    for a, b in zip(spec, base, strict=True):
        assert [t[0] for t in a.topk] == [t[0] for t in b.topk]
        for (_, lp_a), (_, lp_b) in zip(a.topk, b.topk, strict=True):
            torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), atol=1e-4, rtol=1e-4)
    assert sum(g.accepted for g in spec) > 0  # the drafted path really ran
    assert spec[-1].drafted == 0


def test_drafted_decoding_behind_a_shared_head_and_with_a_reference():
    lm = tiny_llama()
    head = ids(40, seed=7)
    prompts = [head + ids(3 + i, seed=20 + i) for i in range(4)]
    plain = [Stream(p, max_new=30) for p in prompts]
    drafted = [Stream(p, max_new=30, draft=3, draft_reference=head + head[:10]) for p in prompts]
    base = generate(lm.model, plain, batch_size=4, share_min=16)
    spec = generate(lm.model, drafted, batch_size=4, share_min=16)
    assert [g.tokens for g in spec] == [g.tokens for g in base]


def test_fewer_steps_when_drafts_are_accepted_and_rejected_columns_are_given_back():
    lm = tiny_llama()
    prompt = repetitive_prompts(1)[0]
    batch = Batch(lm.model)
    batch.join([Stream(prompt, max_new=40, draft=4)])
    steps = 0
    while len(batch):
        [st] = batch.choose()
        steps += 1
        if len(batch):
            batch.advance()
            # every column the stream cannot read is inside the last step's width
            assert int((~batch.allowed[0]).sum()) <= 4
    assert len(st.tokens) == 40 and st.accepted > 0
    assert steps == 40 - st.accepted
