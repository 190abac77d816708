"""SDPA for grouped-query models: no K/V head copies for short queries, no cross-segment work
for packed ones.

With an explicit mask, `transformers` SDPA repeats every K/V head `groups` times before
attending whenever more than one query token runs: a copy of the whole cache per layer
per step. Folding the head group into the query length avoids it for a few tokens at
once (speculative verification, decode steps of several tokens), which otherwise cost
several single-token steps on a CPU. One token is folded too: `transformers` runs it
without a copy (SDPA's grouped-query mode), but on a CPU that kernel is the slower one
(64 streams over 560 columns in bfloat16: 4.0 ms a layer against 2.75 folded).
Query heads `g*groups .. g*groups+groups-1` read K/V head `g`, so folding the group
next to the query positions gives each K/V head all the rows that read it.

Packed training rows hold several conversations behind one cartridge; a dense mask
makes every token score every other conversation's keys only to mask them, which at
four conversations costs about as much as the cartridge rows themselves. Given the
segments' bounds, each segment attends to the prefix columns and its own columns only,
reading the same mask: the same numbers, without the cross-segment blocks.
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
    segments: tuple[tuple[int, int], ...] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if segments is not None and len(segments) > 1 and attention_mask is not None and query.shape[0] == 1:
        return _by_segment(module, query, key, value, attention_mask, dropout, scaling, segments, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, length, dim = query.shape
    foldable = (
        groups > 1 and length <= FOLD_MAX and attention_mask is not None and attention_mask.dim() == 4
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


def _by_segment(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor, dropout: float, scaling: float | None, segments: tuple[tuple[int, int], ...],
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Each segment `[a, b)` of the query against the prefix columns and its own columns only.

    The key columns are the prefix (`key length - query length` of them) then the queries'
    own; exact when no query's mask allows another segment's columns (packing's layout).
    """
    p = key.shape[-2] - query.shape[-2]
    outs = []
    for a, b in segments:
        k = torch.cat([key[:, :, :p], key[:, :, p + a : p + b]], dim=-2)
        v = torch.cat([value[:, :, :p], value[:, :, p + a : p + b]], dim=-2)
        m = torch.cat([attention_mask[..., a:b, :p], attention_mask[..., a:b, p + a : p + b]], dim=-1)
        outs.append(grouped_sdpa(module, query[:, :, a:b], k, v, m, dropout, scaling, **kwargs)[0])
    return torch.cat(outs, dim=1), None


def segment_bounds(segment_ids: torch.Tensor) -> tuple[tuple[int, int], ...] | None:
    """`[a, b)` runs of one packed row's segment ids, or None when a segment id recurs after
    another (its runs could see each other, so splitting would not be exact)."""
    ids = segment_ids.tolist()
    starts = [0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]]
    if len({ids[a] for a in starts}) != len(starts):
        return None
    return tuple(zip(starts, starts[1:] + [len(ids)], strict=True))


AttentionInterface.register(NAME, grouped_sdpa)
# Masks the model builds itself (no explicit mask given) are SDPA's, sliding windows included.
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def use_grouped_sdpa(model: torch.nn.Module) -> None:
    """Switch a model running `transformers` SDPA to the grouped variant (same numbers)."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(NAME)
