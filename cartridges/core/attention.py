"""SDPA for grouped-query models that never copies K/V heads for short queries.

With an explicit mask, `transformers` SDPA repeats every K/V head `groups` times before
attending whenever more than one query token runs: a copy of the whole cache per layer
per step. Decoding one token avoids it by folding the head group into the query
length; this does the same for a few tokens at once (speculative verification, decode
steps of several tokens), which otherwise cost several single-token steps on a CPU.
Query heads `g*groups .. g*groups+groups-1` read K/V head `g`, so folding the group
next to the query positions gives each K/V head all the rows that read it.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "grouped_sdpa"
# Longer queries (prefill, training) repeat K/V as usual: the folded mask would be
# `groups` times the query length and outgrow the repeated heads.
FOLD_MAX = 64


def grouped_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, length, dim = query.shape
    foldable = (
        groups > 1 and 1 < length <= FOLD_MAX and attention_mask is not None and attention_mask.dim() == 4
        and attention_mask.shape[1] == 1 and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
    )
    if not foldable:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    folded = query.reshape(batch, heads // groups, groups * length, dim)
    mask = attention_mask.repeat(1, 1, groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(out.shape[0], heads, length, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, grouped_sdpa)
# Masks the model builds itself (no explicit mask given) are SDPA's, sliding windows included.
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def use_grouped_sdpa(model: torch.nn.Module) -> None:
    """Switch a model running `transformers` SDPA to the grouped variant (same numbers)."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(NAME)
