"""Correctness on the device: the equivalence gate and gradient checks on the tiny models.

Each check compares the engine on the device against a reference that does not share
the mechanism under test:
- gate: an untrained cartridge (one capture, or two parts cut from it and composed)
  against a real prefill of the same tokens (`cartridges.evaluation.equiv.equivalence`); in
  bfloat16 it is judged against the model's own shape sensitivity, in float32 also
  against a bound scaled to the tiny models' small logits.
- finite differences: float64 gradients into the rows of one or two composed parts
  against central differences of the loss (`torch.autograd.gradcheck`), which never
  run the backward.
- gradients: the training gradients (`cartridges.core.train.group_backward`, packed and
  flat) in float32 or bfloat16 on the device against the same weights in float64 on
  the CPU, computed flat.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from cartridges.core.cartridge import Cartridge
from cartridges.core.loss import Targets, student_loss
from cartridges.core.prefix import capture_rows
from cartridges.core.train import Example, group_backward
from cartridges.evaluation.equiv import cut, equivalence
from tests.tiny import TINY

FAMILIES = ("llama", "qwen3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Relative L2 error of training gradients against float64. float32 arithmetic is good to
# about 3e-7 on the tiny models (CPU). bfloat16 rounds every activation and the rows
# themselves to 8 bits: about 6e-3 on the CPU, with a spread of 3e-3 to 4e-3 between two
# shapes of the same computation (packed and flat), so the bound is four bfloat16 units
# or 1.5 times that spread, whichever is larger. A wrong mask, position or row gives
# errors of order one.
GRAD_F32_TOLERANCE = 1e-4
SCALED_F32_TOLERANCE = 1e-4  # of the largest logit, for the float32 gate on the tiny models
GRAD_BF16_FLOOR = 2.0**-6


@contextmanager
def exact_norms() -> Iterator[None]:
    """`transformers` RMSNorms compute in float32 even for float64 inputs; finite differences
    and the float64 reference need the whole forward in float64."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    saved = {cls: cls.forward for cls in (LlamaRMSNorm, Qwen3RMSNorm)}
    for cls in saved:
        cls.forward = forward
    try:
        yield
    finally:
        for cls, fn in saved.items():
            cls.forward = fn


def tiny(family: str, dtype: torch.dtype, device: torch.device, layers: int = 2):
    lm = TINY[family](dtype, layers=layers)
    lm.model.to(device)
    return lm


def gate(family: str, dtype: str, parts: int, device: torch.device, text: str, p: int, suffix: int) -> dict:
    """The project's gate; in float32 also against a bound scaled to the model's logits.

    The gate's 1e-3 suits real models, whose logits run to tens; the tiny models' logits stay
    below about 0.5, where rows at positions off by one move them by only 3e-4. In float32
    a cartridge reproduces a prefill to rounding, so 1e-4 of the largest logit is the bound.
    """
    lm = tiny(family, DTYPES[dtype], device)
    r = equivalence(lm, text, p=p, suffix_max=suffix, parts=parts)
    ok = r["pass"]
    scaled = None
    if dtype == "float32":
        ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"][: r["prefix_rows"] + r["n"]]
        with torch.no_grad():
            largest = lm.model(input_ids=torch.tensor([ids], device=device)).logits.abs().max().item()
        scaled = SCALED_F32_TOLERANCE * largest
        ok = ok and r["max_abs_dlogit"] <= scaled
    return {
        "check": "gate", "model": lm.name, "dtype": dtype, "parts": parts, "p": p, "n": r["n"],
        "max_abs_dlogit": r["max_abs_dlogit"], "tolerance": r["tolerance"], "scaled_tolerance": scaled,
        "own_shape_sensitivity": r["own_shape_sensitivity"], "greedy_agree": r["greedy_agree"],
        "greedy_ties": r["greedy_ties"], "gate_pass": r["pass"], "pass": bool(ok),
    }


def _targets(n_rows: int, positions: list[int], vocab: int, gen: torch.Generator, k: int = 4):
    """Sorted top-k teacher entries per supervised position, one padded (-1) entry."""
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in positions])
    ids[0, -1] = -1
    logprobs = torch.log_softmax(torch.randn(len(positions), k, generator=gen, dtype=torch.float64), -1)
    return ids, logprobs.sort(-1, descending=True).values


def finite_differences(family: str, parts: int, device: torch.device) -> dict:
    """float64 gradients into the trainable rows of `parts` composed parts against central
    differences of the loss (duplicate supervised positions included)."""
    gen = torch.Generator().manual_seed(5 + parts)
    lm = tiny(family, torch.float64, device, layers=1)
    vocab = lm.model.config.vocab_size
    with exact_norms():
        whole = Cartridge.from_rows(capture_rows(lm.model, torch.randint(0, 256, (4 * parts,), generator=gen).to(device)))
        pieces = cut(whole, parts)
        ids = torch.randint(0, 256, (1, 5), generator=gen).to(device)
        positions = [2, 4, 2, 3]
        topk, logprobs = _targets(1, positions, vocab, gen)
        targets = Targets(torch.zeros(len(positions), dtype=torch.long, device=device),
                          torch.tensor(positions, device=device), topk.to(device), logprobs.to(device))
        leaves = [t for c in pieces for t in (c.train_keys[0], c.train_values[0])]

        def loss(*flat):
            layer = [(torch.cat([c.frozen_keys[0], flat[2 * i]], 1), torch.cat([c.frozen_values[0], flat[2 * i + 1]], 1))
                     for i, c in enumerate(pieces)]
            rows = [(torch.cat([k for k, _ in layer], 1), torch.cat([v for _, v in layer], 1))]
            return student_loss(lm.model, rows, ids, targets)

        ok = torch.autograd.gradcheck(loss, leaves, eps=1e-6, atol=1e-6, raise_exception=False)
        # One figure to print: the directional derivative along a random direction, both ways.
        direction = [torch.randn(t.shape, generator=gen, dtype=t.dtype).to(device) for t in leaves]
        grads = torch.autograd.grad(loss(*leaves), leaves)
        analytic = sum((g * d).sum() for g, d in zip(grads, direction, strict=True)).item()
        eps = 1e-6
        with torch.no_grad():
            plus = loss(*[t + eps * d for t, d in zip(leaves, direction, strict=True)]).item()
            minus = loss(*[t - eps * d for t, d in zip(leaves, direction, strict=True)]).item()
        numeric = (plus - minus) / (2 * eps)
    return {
        "check": "finite_differences", "model": lm.name, "dtype": "float64", "parts": parts,
        "directional_analytic": analytic, "directional_numeric": numeric,
        "rel_error": abs(analytic - numeric) / max(abs(numeric), 1e-12), "pass": bool(ok),
    }


def _examples(vocab: int, gen: torch.Generator) -> list[Example]:
    out = []
    for c, (length, answer) in enumerate(((9, 4), (14, 6), (11, 5))):
        ids = torch.randint(0, 256, (length,), generator=gen).tolist()
        positions = list(range(length - answer, length))
        topk, logprobs = _targets(1, positions, vocab, gen, k=6)
        rows_ids = [[i for i in row if i >= 0] for row in topk.tolist()]
        rows_lp = [lp[: len(i)] for lp, i in zip(logprobs.float().tolist(), rows_ids, strict=True)]
        out.append(Example(c, ids, positions, rows_ids, rows_lp))
    return out


def _grads(model, pieces: list[Cartridge], examples: list[Example], packed: bool, device, dtype) -> torch.Tensor:
    parts = [Cartridge.from_rows([(k.to(device, dtype), v.to(device, dtype)) for k, v in c.detached_rows()], c.frozen)
             for c in pieces]
    group_backward(model, parts, examples, packed=packed)
    return torch.cat([t.grad.flatten().double().cpu() for c in parts for t in c.parameters()])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def gradients(family: str, dtype: str, parts: int, device: torch.device) -> dict:
    """Training gradients in `dtype` on the device (packed and flat) against float64 on the CPU."""
    gen = torch.Generator().manual_seed(11 + parts)
    lm = tiny(family, DTYPES[dtype], device)
    vocab = lm.model.config.vocab_size
    examples = _examples(vocab, gen)
    whole = Cartridge.from_rows(capture_rows(lm.model, torch.randint(0, 256, (6 * parts,), generator=gen).to(device)))
    pieces = cut(whole, parts)
    packed = _grads(lm.model, pieces, examples, True, device, torch.float32)
    flat = _grads(lm.model, pieces, examples, False, device, torch.float32)
    reference = copy.deepcopy(lm.model).to("cpu", torch.float64)  # the same weights, computed in float64
    with exact_norms():
        exact = _grads(reference, pieces, examples, False, torch.device("cpu"), torch.float64)
    own = _rel(packed, flat)
    err_packed, err_flat = _rel(packed, exact), _rel(flat, exact)
    if dtype == "float32":
        tolerance = GRAD_F32_TOLERANCE
    else:
        tolerance = max(GRAD_BF16_FLOOR, 1.5 * own)
    cosine = torch.nn.functional.cosine_similarity(packed, exact, dim=0).item()
    return {
        "check": "gradients", "model": lm.name, "dtype": dtype, "parts": parts,
        "rel_error_packed": err_packed, "rel_error_flat": err_flat, "packed_vs_flat": own,
        "cosine_packed": cosine, "tolerance": tolerance,
        "pass": bool(err_packed <= tolerance and err_flat <= tolerance and (dtype != "float32" or own <= tolerance)),
    }


def all_checks(device: torch.device, text: str, p: int, suffix: int) -> list[dict]:
    """Every check for both tiny families, one and two parts, float32 and bfloat16."""
    out = []
    for family in FAMILIES:
        for dtype in DTYPES:
            for parts in (1, 2):
                out.append(gate(family, dtype, parts, device, text, p, suffix))
                out.append(gradients(family, dtype, parts, device))
        for parts in (1, 2):
            out.append(finite_differences(family, parts, device))
    return out
