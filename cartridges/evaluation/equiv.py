"""The equivalence gate: an untrained cartridge must behave like a real prefill.

Capture the model's own rows for the first P raw corpus tokens, then score the next
tokens behind that cartridge (or behind parts cut from the one capture and composed)
and with a real prefill of the whole span. They must agree.
"""

from __future__ import annotations

import time

import torch

from cartridges.core.cartridge import Cartridge, compose_rows
from cartridges.core.errors import CorpusError
from cartridges.core.models import LoadedModel
from cartridges.core.prefix import capture_rows, forward_behind

F32_TOLERANCE = 1e-3


def cut(cart: Cartridge, parts: int) -> list[Cartridge]:
    """Equal parts of one capture, in order."""
    size = cart.p // parts
    out, rest = [], cart
    for _ in range(parts - 1):
        head, rest = rest.split(size)
        out.append(head)
    return out + [rest]


@torch.no_grad()
def equivalence(lm: LoadedModel, text: str, p: int, suffix_max: int = 128, parts: int = 1) -> dict:
    if p < 1 or parts < 1 or suffix_max < 1:
        raise CorpusError(f"--p, --parts and --suffix-max must be positive (got {p}, {parts}, {suffix_max})")
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    prefix = p * parts
    need = prefix + 2
    if len(ids) < need:
        raise CorpusError(
            f"corpus too short: it has {len(ids)} tokens; --p {p} with --parts {parts} needs at least {need}"
        )
    n = min(suffix_max, len(ids) - prefix)
    seq = torch.tensor(ids[: prefix + n], device=lm.device)
    start = time.perf_counter()
    whole = Cartridge.from_rows(capture_rows(lm.model, seq[:prefix]), frozen=1)
    rows = compose_rows(cut(whole, parts))
    behind = forward_behind(lm.model, rows, seq[prefix:].view(1, -1), logits=True)[0].float()
    real = lm.model(input_ids=seq.view(1, -1)).logits[0, prefix:].float()
    seconds = time.perf_counter() - start
    max_dlogit = (behind - real).abs().max().item()
    same = behind.argmax(-1) == real.argmax(-1)
    agree = int(same.sum().item())
    tolerance, own = F32_TOLERANCE, None
    if lm.dtype != torch.float32:
        own = shape_sensitivity(lm, seq, prefix)
        tolerance = max(F32_TOLERANCE, 1.5 * own)
    # A greedy pick that differs where the real prefill's top two logits lie within the
    # tolerance is a tie at this precision, not a difference in what the rows mean.
    top2 = real.topk(2, dim=-1).values
    ties = int(((top2[:, 0] - top2[:, 1]) <= tolerance)[~same].sum().item())
    allowed = 0 if lm.dtype == torch.float32 else ties
    return {
        "model": lm.name,
        "p": p,
        "parts": parts,
        "prefix_rows": prefix,
        "n": n,
        "max_abs_dlogit": max_dlogit,
        "greedy_agree": agree,
        "greedy_ties": ties,
        "tolerance": tolerance,
        "own_shape_sensitivity": own,
        "pass": bool(max_dlogit <= tolerance and agree + allowed == n),
        "seconds": seconds,
    }


@torch.no_grad()
def shape_sensitivity(lm: LoadedModel, seq: torch.Tensor, prefix: int) -> float:
    """How much the model's own logits move when the same rows run in another shape.

    Two real prefills of different lengths must agree on their common positions in
    exact arithmetic; on bf16 or quantized stacks they do not, and that gap is the
    yardstick for the cartridge's gap.
    """
    whole = lm.model(input_ids=seq.view(1, -1)).logits[0, prefix:].float()
    halves = lm.model(input_ids=seq[: prefix + (len(seq) - prefix) // 2].view(1, -1)).logits[0, prefix:].float()
    return (halves - whole[: halves.shape[0]]).abs().max().item()
