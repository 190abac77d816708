"""The one place where cartridge rows enter a model: prefix caches, masks and positions.

Rows are already in cache space (post q/k-norm, post-RoPE at 0..p-1), so they go
straight into a fresh `DynamicCache`; real tokens then run at positions p, p+1, ...
under an explicit 4-D mask in which every real token sees every prefix row and is
causal among real tokens of its own segment (packing) that are not padding.

An explicit mask replaces the one the model would build, sliding window included, so
sliding-window layers get their window here: a query sees the last `window` keys of
those it may see, which is where a real prefix of the same length would sit.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.utils.checkpoint
from transformers import DynamicCache

from cartridges.core.models import backbone, cache_keyword, own_cache

Rows = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer ([H, p, d] keys, values)


def prefix_cache(rows: Rows, batch: int = 1) -> DynamicCache:
    """A fresh cache pre-filled with the prefix rows, broadcast over the batch."""
    data = [
        (k.unsqueeze(0).expand(batch, -1, -1, -1), v.unsqueeze(0).expand(batch, -1, -1, -1))
        for k, v in rows
    ]
    return DynamicCache(ddp_cache_data=data)


class PrefixCache(DynamicCache):
    """A read-only cache: each layer sees its prefix rows ahead of the new keys, nothing is stored.

    Training forwards use it so the forward is a pure function of its inputs, which is
    what lets activation recomputation replay a layer and get the same tensors.
    """

    def __init__(self, rows: Rows, batch: int) -> None:
        super().__init__()
        self._rows = [(k.unsqueeze(0).expand(batch, -1, -1, -1), v.unsqueeze(0).expand(batch, -1, -1, -1)) for k, v in rows]

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if not self._rows:
            return key_states, value_states
        k, v = self._rows[layer_idx]
        return torch.cat([k, key_states], dim=-2), torch.cat([v, value_states], dim=-2)

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return int(self._rows[0][0].shape[-2]) if self._rows else 0


@contextmanager
def recompute_layers(model: torch.nn.Module) -> Iterator[None]:
    """Recompute each decoder layer's activations in the backward instead of keeping them:
    the same gradients at a lower peak memory (pair with a `PrefixCache`)."""
    layers = list(backbone(model).layers)
    for layer in layers:
        def checkpointed(*args, _forward=layer.forward, **kwargs):
            return torch.utils.checkpoint.checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = checkpointed
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def prefix_length(rows: Rows) -> int:
    return int(rows[0][0].shape[1]) if len(rows) else 0


def layout(
    p: int,
    input_shape: tuple[int, int],
    attention_mask: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions `[B, L]` and an allowed-attention matrix `[B, L, p + L]` (bool).

    Segments restart their positions at p (packing); padding (mask 0 or segment -1)
    is never attended to. Every token sees all p prefix rows.
    """
    batch, length = input_shape
    if segment_ids is None:
        segment_ids = torch.zeros(batch, length, dtype=torch.long, device=device)
    if attention_mask is not None:
        segment_ids = torch.where(attention_mask.bool(), segment_ids, -1)
    valid = segment_ids >= 0
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    allowed = same & causal & valid[:, :, None] & valid[:, None, :]
    positions = (same & causal).sum(-1) - 1 + p
    positions = torch.where(valid, positions, p)
    prefix = torch.ones(batch, length, p, dtype=torch.bool, device=segment_ids.device)
    return positions, torch.cat([prefix, allowed], dim=-1)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[B, 1, Q, K]` float mask (0 allowed, dtype min elsewhere) readable by eager and sdpa."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.unsqueeze(1)


def windowed(allowed: torch.Tensor, window: int) -> torch.Tensor:
    """Keep, of the keys each query may see, the last `window` (itself included).

    Keys are in position order and a query's last visible key is itself, so counting
    visible keys from the end gives `1 + query position - key position`: the model's
    own rule (a key is seen when `q - k < window`) read off the mask alone, whatever
    the padding, packing or cache layout.
    """
    from_end = allowed.flip(-1).cumsum(-1, dtype=torch.int32).flip(-1)
    return allowed & (from_end <= window)


def attention_masks(model: torch.nn.Module, allowed: torch.Tensor, dtype: torch.dtype):
    """The additive mask the layers read for `allowed` `[B, Q, K]`: one tensor, or one per
    layer type (`{"full_attention": ..., "sliding_attention": ...}`) where only some slide."""
    cfg = model.config
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:  # Mistral, Phi-3: a configured window applies to every layer
        return additive_mask(windowed(allowed, window) if window else allowed, dtype)
    if not window or "sliding_attention" not in types:
        return additive_mask(allowed, dtype)
    return {
        kind: additive_mask(windowed(allowed, window) if kind == "sliding_attention" else allowed, dtype)
        for kind in sorted(set(types))
    }


def forward_behind(
    model: torch.nn.Module,
    rows: Rows,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    logits: bool = False,
    use_cache: bool = False,
    checkpoint: bool = False,
):
    """Run real tokens behind prefix rows in a fresh cache.

    Returns final-norm hidden states `[B, L, D]` (or logits with `logits=True`); with
    `use_cache` also the cache, which then holds the prefix plus these tokens for
    decoding to continue. `checkpoint` recomputes layer activations in the backward.
    """
    batch, length = input_ids.shape
    p = prefix_length(rows)
    positions, allowed = layout(p, (batch, length), attention_mask, segment_ids, input_ids.device)
    dtype = next(model.parameters()).dtype
    if p and rows[0][0].dtype != dtype:  # float32 cartridge rows behind a bfloat16 model
        rows = [(k.to(dtype), v.to(dtype)) for k, v in rows]
    if use_cache:
        cache = prefix_cache(rows, batch) if p else DynamicCache()
    else:
        cache = PrefixCache(rows, batch)
    target = model if logits else backbone(model)
    kwargs = {
        "input_ids": input_ids, "attention_mask": attention_masks(target, allowed, dtype), "position_ids": positions,
        "use_cache": True, cache_keyword(target): cache,
    }
    if checkpoint and torch.is_grad_enabled():
        with recompute_layers(model):
            out = target(**kwargs)
    else:
        out = target(**kwargs)
    result = out.logits if logits else out.last_hidden_state
    return (result, cache) if use_cache else result


@torch.no_grad()
def capture_rows(model: torch.nn.Module, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The model's own cache rows for a token sequence `[T]`: per layer `[H, T, d]`."""
    return [(k[0].detach().clone(), v[0].detach().clone()) for k, v in own_cache(model, input_ids.view(1, -1))]
