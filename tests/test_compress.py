"""Compression peers: kept keys re-rotated to contiguous positions equal a real prefill."""

from __future__ import annotations

import torch

from cartridges.compress import (
    first_rows,
    knorm_keep,
    knorm_rows,
    reposition,
    rotary_of,
    snapkv_keep,
)
from cartridges.prefix import capture_rows
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
