"""Grouped SDPA: a few query tokens attend without repeating K/V heads, with the same numbers."""

from __future__ import annotations

import pytest
import torch

from cartridges.core.attention import FOLD_MAX, grouped_sdpa
from cartridges.core.prefix import additive_mask
from tests.tiny import tiny_llama


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
