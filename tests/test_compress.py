"""Compression peers: kept keys re-rotated to contiguous positions equal a real prefill."""

from __future__ import annotations

import pytest
import torch

from cartridges.core.cartridge import init_cartridge, init_from_corpus, init_from_snapkv
from cartridges.core.chat import system_ids
from cartridges.core.compress import (
    first_rows,
    knorm_keep,
    knorm_rows,
    reposition,
    rotary_of,
    snapkv_keep,
    snapkv_questions_keep,
)
from cartridges.core.errors import CorpusError
from cartridges.core.prefix import capture_rows
from tests.tiny import tiny_llama


def test_reposition_equals_the_keys_of_the_kept_tokens_prefilled_alone():
    # Layer 0 keys depend only on each token and its position, so the kept tokens
    # prefilled on their own (at 0..n-1) are an independent reference.
    lm = tiny_llama(dtype=torch.float64)
    ids = torch.randint(0, 250, (40,))
    rows = capture_rows(lm.model, ids)
    keep = torch.tensor([1, 5, 6, 17, 30, 39])
    k0 = rows[0][0]
    heads = k0.shape[0]
    old = keep.expand(heads, -1)
    moved = reposition(rotary_of(lm.model), k0[:, keep], old)
    alone = capture_rows(lm.model, ids[keep])[0][0]
    # the model computes its rotary angles in float32, hence the tolerance
    torch.testing.assert_close(moved, alone, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(k0[:, keep], alone)  # without re-rotation they differ


def test_knorm_keeps_each_heads_lowest_norm_keys_in_order():
    lm = tiny_llama(dtype=torch.float64)
    rows = capture_rows(lm.model, torch.randint(0, 250, (30,)))
    keep = knorm_keep(rows, 8)
    for (k, _), idx in zip(rows, keep, strict=True):
        norms = k.norm(dim=-1)
        for h in range(k.shape[0]):
            assert idx[h].tolist() == sorted(idx[h].tolist())
            assert norms[h, idx[h]].max() <= norms[h].sort().values[7] + 1e-12
    kept = knorm_rows(rows, 8)  # without a rotary: the rows as they were
    k, v = rows[1]
    torch.testing.assert_close(kept[1][1], v.gather(1, keep[1][..., None].expand(-1, -1, v.shape[-1])))
    assert [r[0].shape[1] for r in first_rows(rows, 5)] == [5] * len(rows)


def test_snapkv_keeps_the_window_and_the_positions_it_attends_to_most():
    # Reference: the library's own attention weights (output_attentions), pooled by hand.
    lm = tiny_llama(dtype=torch.float64)
    ids = torch.randint(0, 250, (50,))
    kv_heads, budget, window = 2, 12, 4
    keep = snapkv_keep(lm.model, ids, kv_heads, budget, window=window, kernel=1)
    assert lm.model.config._attn_implementation != "eager"  # restored
    lm.model.set_attn_implementation("eager")
    attentions = lm.model(ids.view(1, -1), output_attentions=True).attentions
    lm.model.set_attn_implementation("sdpa")
    for layer, att in enumerate(attentions):
        score = att[0, :, -window:, :-window].mean(dim=1).view(kv_heads, 2, -1).mean(dim=1)
        for h in range(kv_heads):
            want = set(score[h].topk(budget - window).indices.tolist()) | set(range(50 - window, 50))
            assert keep[layer][h].tolist() == sorted(want)
    assert [k.shape for k in snapkv_keep(lm.model, ids[:10], kv_heads, budget)] == [(2, 10)] * 2


def test_snapkv_keeps_the_first_positions_asked_for_even_when_they_score_lowest():
    lm = tiny_llama(dtype=torch.float64)
    ids = torch.randint(0, 250, (50,))
    plain = snapkv_keep(lm.model, ids, 2, 12, window=4, kernel=1)
    pinned = snapkv_keep(lm.model, ids, 2, 12, window=4, kernel=1, first=3)
    for free, keep in zip(plain, pinned, strict=True):
        for h in range(2):
            assert keep[h][:3].tolist() == [0, 1, 2]
            # what the pins displace are the lowest-scored of the unpinned choice; the rest stay
            assert set(keep[h].tolist()) - {0, 1, 2} <= set(free[h].tolist())
            assert len(set(keep[h].tolist())) == 12


def test_snapkv_init_spans_the_corpus_keeps_the_sink_and_preserves_relative_positions():
    # References: the corpus init's own sink row, and the full prefill's rows at the kept positions,
    # which must attend the same to any query placed at the same distance.
    lm = tiny_llama(dtype=torch.float64)
    text = "Cartridges replace a long document in context. Self-study asks about every fact. " * 3
    p = 48  # past the 32-position window, so scored rows are kept too
    ids = torch.tensor(system_ids(lm.tokenizer, text))
    assert ids.numel() > 3 * p
    cart = init_from_snapkv(lm, text, p)
    corpus = init_from_corpus(lm, text, p)
    full = capture_rows(lm.model, ids)
    keep = snapkv_keep(lm.model, ids, full[0][0].shape[0], p, first=1)
    rotary = rotary_of(lm.model)
    assert cart.p == p and cart.frozen == 1
    for (k, v), (k0, v0), (fk, fv), idx in zip(cart.rows(), corpus.rows(), full, keep, strict=True):
        torch.testing.assert_close(k[:, 0], k0[:, 0].to(k.dtype))  # the sink, exactly
        torch.testing.assert_close(v[:, 0], v0[:, 0].to(v.dtype))
        assert idx.max() >= p  # rows from past the first p tokens
        torch.testing.assert_close(v, fv.gather(1, idx[..., None].expand(-1, -1, fv.shape[-1])).to(v.dtype))
        # q at position m against the original key at j scores as q at (m - j + rank) against the kept row
        q = torch.randn(k.shape[0], 1, k.shape[-1], dtype=torch.float64)
        m = ids.numel() + 5
        for h in range(k.shape[0]):
            for rank, j in enumerate(idx[h].tolist()):
                qa = _rotated(rotary, q[h], m)
                qb = _rotated(rotary, q[h], m - j + rank)
                ref = (qa * fk[h, j].double()).sum()
                got = (qb * k[h, rank].double()).sum()
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def _rotated(rotary, q: torch.Tensor, position: int) -> torch.Tensor:
    cos, sin = rotary(q[None], torch.tensor([[position]]))
    half = q.shape[-1] // 2
    turned = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
    return (q * cos[0].double() + turned * sin[0].double())[0]


def test_snapkv_init_refuses_a_corpus_shorter_than_the_cartridge():
    lm = tiny_llama()
    text = "A short note."
    n = len(system_ids(lm.tokenizer, text))
    with pytest.raises(CorpusError, match=rf"too short for p={n + 1}"):
        init_from_snapkv(lm, text, n + 1)


def test_snapkv_init_refuses_a_model_whose_layers_rotate_differently():
    from cartridges.core.errors import ModelError
    from tests.tiny import tiny_gemma3

    lm = tiny_gemma3()
    with pytest.raises(ModelError, match="init 'snapkv' needs one plain rotary embedding for every layer"):
        init_from_snapkv(lm, "Cartridges replace a long document in context. " * 8, 16)


def test_snapkv_init_with_more_frozen_rows_holds_the_corpus_opening_exactly():
    # Reference: the corpus init, whose rows are a real prefill of the corpus's first p tokens.
    lm = tiny_llama(dtype=torch.float64)
    text = "Cartridges replace a long document in context. Self-study asks about every fact. " * 3
    p, frozen = 48, 20
    cart = init_from_snapkv(lm, text, p, frozen=frozen)
    corpus = init_from_corpus(lm, text, p)
    assert cart.frozen == frozen
    for (k, v), (k0, v0) in zip(cart.rows(), corpus.rows(), strict=True):
        torch.testing.assert_close(k[:, :frozen], k0[:, :frozen].to(k.dtype))
        torch.testing.assert_close(v[:, :frozen], v0[:, :frozen].to(v.dtype))
        assert not torch.allclose(v[:, frozen:], v0[:, frozen:].to(v.dtype))  # the rest chosen from further on


def test_auto_init_is_snapkv_where_the_model_allows_it_and_the_corpus_init_elsewhere():
    # References: the two inits called directly on the same text.
    from tests.tiny import tiny_gemma3

    text = "Cartridges replace a long document in context. Self-study asks about every fact. " * 3
    for lm, direct, name in ((tiny_llama(dtype=torch.float64), init_from_snapkv, "snapkv"),
                             (tiny_gemma3(), init_from_corpus, "corpus")):
        auto, ref = init_cartridge(lm, text, "auto", 24, frozen=4), direct(lm, text, 24, 4)
        assert auto.meta["init"] == name and auto.frozen == 4
        for (k, v), (k0, v0) in zip(auto.rows(), ref.rows(), strict=True):
            torch.testing.assert_close(k, k0)
            torch.testing.assert_close(v, v0)
    with pytest.raises(ValueError, match="init 'nope'"):
        init_cartridge(tiny_llama(), text, "nope", 24)


def test_a_run_that_names_no_frozen_rows_holds_half_of_p_under_snapkv_and_one_sink_row_otherwise():
    # References: the inits called directly with the row counts spelled out.
    from tests.tiny import tiny_gemma3

    text = "Cartridges replace a long document in context. Self-study asks about every fact. " * 3
    for lm, direct, frozen in ((tiny_llama(dtype=torch.float64), init_from_snapkv, 12),
                               (tiny_gemma3(), init_from_corpus, 1)):
        auto, ref = init_cartridge(lm, text, "auto", 24), direct(lm, text, 24, frozen)
        assert auto.frozen == ref.frozen == frozen
        for (k, v), (k0, v0) in zip(auto.rows(), ref.rows(), strict=True):
            torch.testing.assert_close(k, k0)
            torch.testing.assert_close(v, v0)
    lm = tiny_llama(dtype=torch.float64)
    assert init_cartridge(lm, text, "corpus", 24).frozen == 1
    assert init_cartridge(lm, text, "random", 24).frozen == 1


def test_snapkv_with_questions_keeps_what_the_questions_after_the_document_attend_to_most():
    # Reference: each question prefilled right after the document in one plain forward (no cache),
    # the library's own attention weights of the question's rows over the document, pooled by hand.
    lm = tiny_llama(dtype=torch.float64)
    ids = torch.randint(0, 250, (50,))
    questions = [torch.randint(0, 250, (n,)) for n in (3, 7, 5)]
    kv_heads, budget, first = 2, 12, 2
    rows = capture_rows(lm.model, ids)
    keep = snapkv_questions_keep(lm.model, rows, budget, questions, kernel=1, first=first)
    assert lm.model.config._attn_implementation != "eager"  # restored
    lm.model.set_attn_implementation("eager")
    per_question = [lm.model(torch.cat([ids, q]).view(1, -1), output_attentions=True).attentions
                    for q in questions]
    lm.model.set_attn_implementation("sdpa")
    for layer in range(len(keep)):
        score = sum(att[layer][0, :, 50:, :50].mean(dim=1) for att in per_question)
        score = score.view(kv_heads, 2, -1).mean(dim=1)
        score[:, :first] = float("inf")
        for h in range(kv_heads):
            assert keep[layer][h].tolist() == sorted(score[h].topk(budget).indices.tolist())
    plain = snapkv_keep(lm.model, ids, kv_heads, budget, window=4, kernel=1, first=first)
    assert any(not torch.equal(a, b) for a, b in zip(keep, plain, strict=True))  # the window matters
    with pytest.raises(ValueError, match="at least one question"):
        snapkv_questions_keep(lm.model, rows, budget, [])


def test_snapkv_questions_init_holds_the_opening_and_the_rows_the_questions_choose():
    # References: the corpus init (a real prefill of the opening), the full prefill's rows at the
    # positions snapkv_questions_keep chooses, and the tail-window snapkv init it must differ from.
    lm = tiny_llama(dtype=torch.float64)
    text = "Cartridges replace a long document in context. Self-study asks about every fact. " * 3
    p, frozen = 48, 8
    questions = [lm.tokenizer("What replaces a long document?")["input_ids"],
                 lm.tokenizer("Who asks about every fact?")["input_ids"]]
    cart = init_cartridge(lm, text, "snapkv_questions", p, frozen, questions=questions)
    assert cart.meta["init"] == "snapkv_questions" and cart.frozen == frozen
    ids = torch.tensor(system_ids(lm.tokenizer, text))
    full = capture_rows(lm.model, ids)
    keep = snapkv_questions_keep(lm.model, full, p, [torch.tensor(q) for q in questions], first=frozen)
    corpus, tail = init_from_corpus(lm, text, p), init_from_snapkv(lm, text, p, frozen)
    for (k, v), (k0, v0), (_, fv), (_, _tv), idx in zip(cart.rows(), corpus.rows(), full, tail.rows(), keep,
                                                       strict=True):
        torch.testing.assert_close(k[:, :frozen], k0[:, :frozen].to(k.dtype))
        torch.testing.assert_close(v[:, :frozen], v0[:, :frozen].to(v.dtype))
        torch.testing.assert_close(v, fv.gather(1, idx[..., None].expand(-1, -1, fv.shape[-1])).to(v.dtype))
        assert idx.max() >= p
    assert any(not torch.allclose(v, tv) for (_, v), (_, tv) in zip(cart.rows(), tail.rows(), strict=True))
    assert init_cartridge(lm, text, "snapkv_questions", p, questions=questions).frozen == p // 2
    with pytest.raises(ValueError, match="needs self-study questions"):
        init_cartridge(lm, text, "snapkv_questions", p)
