"""Grouped SDPA: a few query tokens attend without repeating K/V heads, with the same numbers."""

from __future__ import annotations

import pytest
import torch

from cartridges import attention
from cartridges.attention import FOLD_MAX, grouped_sdpa, segment_bounds
from cartridges.cartridge import Cartridge
from cartridges.prefix import additive_mask, capture_rows, layout, windowed
from cartridges.train import group_backward
from tests.test_teacher_train import random_examples
from tests.tiny import tiny_gemma3, tiny_llama


class _Grouped(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


def _repeated(query, key, value, mask, groups):
    """The plain computation: every K/V head repeated for its query heads."""
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    return out.transpose(1, 2)


@pytest.mark.parametrize("length", [1, 2, 5, FOLD_MAX, FOLD_MAX + 3])
def test_folded_heads_match_repeated_heads(length):
    gen = torch.Generator().manual_seed(length)
    batch, kv_heads, groups, cols, dim = 3, 2, 3, 17, 8
    query = torch.randn(batch, kv_heads * groups, length, dim, generator=gen)
    key = torch.randn(batch, kv_heads, cols + length, dim, generator=gen)
    value = torch.randn(batch, kv_heads, cols + length, dim, generator=gen)
    allowed = torch.rand(batch, length, cols + length, generator=gen) > 0.3
    allowed[..., -1] = True  # every query sees at least one key
    mask = additive_mask(allowed, torch.float32)
    out, _ = grouped_sdpa(_Grouped(groups), query, key, value, mask)
    torch.testing.assert_close(out, _repeated(query, key, value, mask, groups), atol=1e-5, rtol=1e-5)


def test_models_run_grouped_sdpa_and_decode_several_tokens_like_sdpa():
    lm = tiny_llama()
    assert lm.model.config._attn_implementation == "grouped_sdpa"
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = additive_mask(torch.ones(2, 12, 12, dtype=torch.bool).tril(), torch.float32)
    with torch.no_grad():
        ours = lm.model(input_ids=ids, attention_mask=mask).logits
        lm.model.set_attn_implementation("sdpa")
        theirs = lm.model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def _packed_mask(p: int, lengths: list[int], window: int | None) -> torch.Tensor:
    """Every query sees the p prefix columns and its own segment causally (packing's layout)."""
    segments = torch.cat([torch.full((n,), s) for s, n in enumerate(lengths)])[None]
    _, allowed = layout(p, tuple(segments.shape), segment_ids=segments)
    return windowed(allowed, window) if window else allowed


@pytest.mark.parametrize("window", [None, 9])
def test_segmented_attention_matches_the_dense_packed_mask(window):
    gen = torch.Generator().manual_seed(3)
    kv_heads, groups, p, dim = 2, 3, 11, 8
    lengths = [5, FOLD_MAX + 4, 1, 7]  # folded, repeated and single-token segments
    total = sum(lengths)
    query = torch.randn(1, kv_heads * groups, total, dim, generator=gen)
    key = torch.randn(1, kv_heads, p + total, dim, generator=gen)
    value = torch.randn(1, kv_heads, p + total, dim, generator=gen)
    mask = additive_mask(_packed_mask(p, lengths, window), torch.float32)
    bounds = segment_bounds(torch.cat([torch.full((n,), s) for s, n in enumerate(lengths)]))
    assert bounds == ((0, 5), (5, 5 + FOLD_MAX + 4), (FOLD_MAX + 9, FOLD_MAX + 10), (FOLD_MAX + 10, total))
    split, _ = grouped_sdpa(_Grouped(groups), query, key, value, mask, segments=bounds)
    dense, _ = grouped_sdpa(_Grouped(groups), query, key, value, mask)
    torch.testing.assert_close(split, dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split, _repeated(query, key, value, mask, groups), atol=1e-5, rtol=1e-5)


def test_segment_bounds_refuse_a_segment_that_recurs():
    assert segment_bounds(torch.tensor([0, 0, 1, 1, 1, 2])) == ((0, 2), (2, 5), (5, 6))
    assert segment_bounds(torch.tensor([4])) == ((0, 1),)
    assert segment_bounds(torch.tensor([0, 0, 1, 0])) is None  # the two runs of 0 see each other


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_packed_training_attends_by_segment_with_the_dense_gradients(make, monkeypatch):
    lm = make()
    base = Cartridge.from_rows(capture_rows(lm.model, torch.arange(10) + 30))
    examples = random_examples(3, seed=4)
    calls = []
    by_segment = attention._by_segment
    monkeypatch.setattr(attention, "_by_segment", lambda *a, **k: calls.append(len(a[-1])) or by_segment(*a, **k))
    grads = []
    for implementation in (attention.NAME, "sdpa"):  # split by segment, then one dense mask
        lm.model.set_attn_implementation(implementation)
        cart = Cartridge.from_rows(base.detached_rows())
        group_backward(lm.model, [cart], examples, packed=True)
        grads.append([p.grad.clone() for p in cart.parameters()])
    assert calls and set(calls) == {3}  # every layer split the three conversations
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in grads[0])
