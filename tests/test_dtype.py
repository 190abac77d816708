"""A bfloat16 model hosts float32 cartridge rows: same fingerprint, float32 leaves and moments."""

from __future__ import annotations

import pytest
import torch

from cartridges.core.cartridge import init_from_corpus
from cartridges.core.errors import ModelError
from cartridges.core.models import LoadedModel, parse_dtype, wrap
from cartridges.core.train import group_backward, make_optimizer
from tests.test_teacher_train import random_examples
from tests.tiny import tiny_llama

CORPUS = "Cartridges are trained key-value prefixes. " * 8


def as_bf16(lm: LoadedModel) -> LoadedModel:
    return wrap(lm.model.to(torch.bfloat16), lm.tokenizer, lm.name)


def test_one_fingerprint_across_dtypes_but_separate_compute_ids():
    f32, bf16 = tiny_llama(), as_bf16(tiny_llama())
    assert f32.fingerprint == bf16.fingerprint
    assert f32.compute_id != bf16.compute_id


def test_bf16_model_trains_float32_rows_with_float32_moments():
    f32 = tiny_llama()
    ref = init_from_corpus(f32, CORPUS, p=12)
    lm = as_bf16(tiny_llama())
    cart = init_from_corpus(lm, CORPUS, p=12)
    assert cart.dtype == torch.float32
    # The bf16 model's own rows, held in float32: within bf16 rounding of the float32 model's rows.
    for (k, v), (rk, rv) in zip(cart.detached_rows(), ref.detached_rows(), strict=True):
        torch.testing.assert_close(k, rk, atol=0.05, rtol=0.02)
        torch.testing.assert_close(v, rv, atol=0.05, rtol=0.02)
    examples = random_examples(2)
    loss = group_backward(lm.model, [cart], examples)
    ref_loss = group_backward(f32.model, [ref], examples)
    assert loss == pytest.approx(ref_loss, rel=0.03)
    grads = [p.grad for p in cart.parameters()]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
    opt = make_optimizer(cart, 1e-2)
    opt.step()
    state = opt.state[cart.parameters()[0]]
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32


def test_dtype_names():
    assert parse_dtype("bfloat16") is torch.bfloat16 and parse_dtype("auto") is None and parse_dtype(None) is None
    with pytest.raises(ModelError, match="--dtype int8"):
        parse_dtype("int8")


def test_bf16_gate_passes_and_excuses_only_near_ties(monkeypatch):
    from cartridges.evaluation import equiv

    lm = as_bf16(tiny_llama())
    text = "".join(chr(97 + (i * 7) % 26) for i in range(200))
    report = equiv.equivalence(lm, text, p=16, suffix_max=32)
    assert report["pass"] and report["own_shape_sensitivity"] is not None
    assert report["greedy_agree"] + report["greedy_ties"] >= report["n"]
    # Rows from other tokens are no tie at any precision: the gate fails.
    real_capture = equiv.capture_rows
    monkeypatch.setattr(equiv, "capture_rows", lambda model, ids: real_capture(model, ids.flip(0)))
    assert not equiv.equivalence(lm, text, p=16, suffix_max=32)["pass"]
