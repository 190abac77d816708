"""KV-cache compression peers: a document's full KV cut to a cartridge's row budget.

A cartridge's question tokens run at positions p, p+1, ... behind its p rows. Kept
rows of a compressed cache carry keys rotated for their original positions (up to
the document's length), so served as-is the question would sit *before* most of
them. `reposition` re-rotates each kept key to its rank among the kept rows, so the
compressed cache is contiguous at 0..budget-1 like any cartridge (rotations compose:
R(new) = R(new - old) R(old)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cartridges.core.models import backbone
from cartridges.core.prefix import forward_behind

Rows = list[tuple[torch.Tensor, torch.Tensor]]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_of(model: torch.nn.Module):
    """The model's rotary embedding module, when it has a plain one (None otherwise)."""
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    if rotary is None or float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        return None
    return rotary


def reposition(rotary, keys: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Keys [heads, n, d] rotated for positions `old` [heads, n], re-rotated to 0..n-1."""
    heads, n, dim = keys.shape
    delta = torch.arange(n, device=keys.device)[None, :] - old
    cos, sin = rotary(keys, delta.reshape(1, -1))
    cos, sin = cos.reshape(heads, n, -1), sin.reshape(heads, n, -1)
    if cos.shape[-1] != dim:
        raise ValueError(f"rotary dim {cos.shape[-1]} != head dim {dim}: partial rotary is not supported")
    k = keys.float()
    return (k * cos.float() + _rotate_half(k) * sin.float()).to(keys.dtype)


def keep_rows(rows: Rows, keep: list[torch.Tensor], rotary) -> Rows:
    """Per layer, the rows at `keep` [heads, budget] (ascending), keys re-rotated when `rotary` is given."""
    out = []
    for (k, v), idx in zip(rows, keep, strict=True):
        index = idx[..., None]
        kk = k.gather(1, index.expand(-1, -1, k.shape[-1]))
        vv = v.gather(1, index.expand(-1, -1, v.shape[-1]))
        out.append((reposition(rotary, kk, idx) if rotary is not None else kk, vv))
    return out


def knorm_keep(rows: Rows, budget: int) -> list[torch.Tensor]:
    """Per layer and KV head, the positions of the `budget` lowest-norm keys, ascending."""
    return [k.float().norm(dim=-1).topk(budget, dim=-1, largest=False).indices.sort(dim=-1).values
            for k, _ in rows]


def _attention_to(model: torch.nn.Module, run, n: int, queries_from: int = 0) -> list[torch.Tensor]:
    """Per layer, the summed attention [heads, n] that `run()`'s forward passes pay to positions
    0..n-1, each pass's weights averaged over its query tokens from `queries_from` on (eager
    attention is the only implementation that returns them)."""
    layers = backbone(model).layers
    sums: list[torch.Tensor | None] = [None] * len(layers)

    def hook_for(i: int):
        def hook(_module, _args, out) -> None:
            w = out[1][0, :, queries_from:, :n].float().mean(dim=1)
            sums[i] = w if sums[i] is None else sums[i] + w
        return hook

    previous = model.config._attn_implementation
    handles = [layer.self_attn.register_forward_hook(hook_for(i)) for i, layer in enumerate(layers)]
    try:
        model.set_attn_implementation("eager")
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
        model.set_attn_implementation(previous)
    return sums  # type: ignore[return-value]


def _choose(scores: list[torch.Tensor], kv_heads: int, picks: int, kernel: int, first: int,
            always: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Per layer and KV head, the `picks` best-scored positions (scores averaged over the head's
    query group, pooled over neighbours), the first `first` whatever their score, plus `always`."""
    keep = []
    for s in scores:
        s = s.view(kv_heads, -1, s.shape[-1]).mean(dim=1)
        s = F.avg_pool1d(s[:, None], kernel, stride=1, padding=kernel // 2, count_include_pad=False)[:, 0]
        s[:, :first] = float("inf")
        top = s.topk(picks, dim=-1).indices
        keep.append((top if always is None else torch.cat([top, always], dim=-1)).sort(dim=-1).values)
    return keep


def snapkv_keep(model: torch.nn.Module, input_ids: torch.Tensor, kv_heads: int, budget: int,
                window: int = 32, kernel: int = 5, first: int = 0) -> list[torch.Tensor]:
    """SnapKV's choice, question-agnostic: per layer and KV head, the last `window` positions
    plus the `budget - window` earlier ones that those positions attend to most (attention
    averaged over the window and the head's query group, then pooled over neighbours).
    The first `first` positions are kept whatever their score (a cartridge's frozen sink rows)."""
    n = input_ids.numel()
    if n <= budget:
        return [torch.arange(n, device=input_ids.device).expand(kv_heads, -1)] * len(backbone(model).layers)
    window = min(window, budget - first)

    def run() -> None:
        model(input_ids=input_ids.view(1, -1), use_cache=False, logits_to_keep=1)

    scores = _attention_to(model, run, n - window, queries_from=n - window)
    tail = torch.arange(n - window, n, device=input_ids.device).expand(kv_heads, -1)
    return _choose(scores, kv_heads, budget - window, kernel, first, tail)


def snapkv_questions_keep(model: torch.nn.Module, rows: Rows, budget: int, questions: list[torch.Tensor],
                          kernel: int = 5, first: int = 0) -> list[torch.Tensor]:
    """SnapKV's choice with questions as the observation window: per layer and KV head, the
    `budget` of a prefill's `rows` that the questions, each run right behind them, attend to
    most (the first `first` kept whatever their score). Self-study's questions are the ones a
    cartridge is trained to answer; a document's own tail only stands in for them."""
    kv_heads, n = rows[0][0].shape[:2]
    if n <= budget:
        return [torch.arange(n, device=rows[0][0].device).expand(kv_heads, -1)] * len(rows)
    if not questions:
        raise ValueError("snapkv with questions as the window needs at least one question")

    def run() -> None:
        for q in questions:
            forward_behind(model, rows, q.view(1, -1))

    return _choose(_attention_to(model, run, n), kv_heads, budget, kernel, first)


def knorm_rows(rows: Rows, budget: int, rotary=None) -> Rows:
    """The knorm press: keep each head's lowest-norm keys (low key norm predicts high attention)."""
    return keep_rows(rows, knorm_keep(rows, budget), rotary)


def snapkv_rows(model: torch.nn.Module, input_ids: torch.Tensor, rows: Rows, budget: int, rotary=None,
                first: int = 0) -> Rows:
    """SnapKV's press over a prefill's `rows` of `input_ids`, keys re-rotated when `rotary` is given."""
    return keep_rows(rows, snapkv_keep(model, input_ids, rows[0][0].shape[0], budget, first=first), rotary)


def first_rows(rows: Rows, budget: int) -> Rows:
    """The first `budget` rows: the untrained corpus-init cartridge (already at 0..budget-1)."""
    return [(k[:, :budget], v[:, :budget]) for k, v in rows]
