"""Training a cartridge by context distillation: examples, packed groups, Adam steps.

A group of conversations (the accumulation group) makes one optimizer step; its loss
is the mean over all of the group's supervised positions. Packed: the group's
student sequences run as one row with per-segment positions and a block mask, one
backward. Flat: one forward/backward per conversation, each scaled by the group's
position count. Both give the same gradients (pinned by a test).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cartridges.core.cartridge import Cartridge, compose_rows
from cartridges.core.loss import Targets, student_loss


@dataclass
class Example:
    """One conversation as the student sees it, with its teacher targets."""

    conv_id: int
    ids: list[int]  # student sequence
    positions: list[int]  # supervised token positions in `ids`
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]

    @property
    def n(self) -> int:
        return len(self.positions)


def pad_topk(rows_ids: list[list[int]], rows_lp: list[list[float]], device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows_ids)
    ids = torch.full((len(rows_ids), width), -1, dtype=torch.long)
    lps = torch.zeros(len(rows_ids), width, dtype=torch.float32)
    for n, (i, lp) in enumerate(zip(rows_ids, rows_lp, strict=True)):
        ids[n, : len(i)] = torch.tensor(i, dtype=torch.long)
        lps[n, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
    return ids.to(device), lps.to(device)


def packed_batch(examples: list[Example], device) -> tuple[torch.Tensor, torch.Tensor, Targets]:
    """One row holding every example as its own segment; target positions shifted to match."""
    ids, segments, rows, positions, tk_ids, tk_lps = [], [], [], [], [], []
    offset = 0
    for s, ex in enumerate(examples):
        ids += ex.ids
        segments += [s] * len(ex.ids)
        positions += [offset + p for p in ex.positions]
        rows += [0] * ex.n
        tk_ids += ex.topk_ids
        tk_lps += ex.topk_logprobs
        offset += len(ex.ids)
    t_ids, t_lps = pad_topk(tk_ids, tk_lps, device)
    targets = Targets(torch.tensor(rows, device=device), torch.tensor(positions, device=device), t_ids, t_lps)
    return torch.tensor([ids], device=device), torch.tensor([segments], device=device), targets


def single_batch(ex: Example, device) -> tuple[torch.Tensor, Targets]:
    t_ids, t_lps = pad_topk(ex.topk_ids, ex.topk_logprobs, device)
    targets = Targets(torch.zeros(ex.n, dtype=torch.long, device=device), torch.tensor(ex.positions, device=device), t_ids, t_lps)
    return torch.tensor([ex.ids], device=device), targets


def group_backward(
    model: torch.nn.Module, parts: list[Cartridge], examples: list[Example], packed: bool = True,
    checkpoint: bool = False,
) -> float:
    """Accumulate the group's mean-over-positions loss gradient into the cartridge leaves."""
    device = next(model.parameters()).device
    total = sum(ex.n for ex in examples)
    if total == 0:
        return 0.0
    if packed:
        ids, segments, targets = packed_batch(examples, device)
        loss = student_loss(model, compose_rows(parts), ids, targets, segment_ids=segments, reduction="sum",
                            checkpoint=checkpoint) / total
        loss.backward()
        return float(loss.item())
    value = 0.0
    for ex in examples:
        ids, targets = single_batch(ex, device)
        loss = student_loss(model, compose_rows(parts), ids, targets, reduction="sum", checkpoint=checkpoint) / total
        loss.backward()
        value += float(loss.item())
    return value


@torch.no_grad()
def mean_loss(model: torch.nn.Module, parts: list[Cartridge], examples: list[Example]) -> float | None:
    """Mean distillation loss over every supervised position of `examples` (held-out scoring)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    rows = compose_rows(parts)
    for ex in examples:
        if ex.n == 0:
            continue
        ids, targets = single_batch(ex, device)
        total += float(student_loss(model, rows, ids, targets, reduction="sum").item())
        count += ex.n
    return total / count if count else None


def make_optimizer(cart: Cartridge, lr: float) -> torch.optim.Adam:
    """Adam with weight decay exactly 0 over the trainable rows only."""
    return torch.optim.Adam(cart.parameters(), lr=lr, weight_decay=0.0)


class TailAverage:
    """The uniform mean of the trainable rows over the last `share` of a run's steps (Polyak
    averaging). At a constant rate the rows after the last step carry that step's noise; their
    mean over the tail carries less of it. On `raft.md` it lowered the held-out loss but tied on
    the gold NLL (experiments/LAB.md), so training keeps the last rows by default."""

    def __init__(self, share: float, total: int) -> None:
        self.start = total - math.ceil(share * total)  # the first 0-based step averaged
        self.mean: list[torch.Tensor] | None = None

    def update(self, step: int, cart: Cartridge) -> None:
        """Fold in the rows as they stand after 0-based `step`."""
        if step < self.start:
            return
        now = [p.detach() for p in cart.parameters()]
        if self.mean is None:
            self.mean = [x.clone() for x in now]
            return
        n = step - self.start + 1
        for m, x in zip(self.mean, now, strict=True):
            m.add_(x - m, alpha=1.0 / n)

    def result(self, cart: Cartridge) -> Cartridge:
        """`cart` with the mean as its trainable rows (itself when nothing was averaged)."""
        return cart if self.mean is None else cart.with_trainable(self.mean)


def lr_at(step: int, total: int, lr: float, schedule: str = "constant", warmup: float = 0.0) -> float:
    """The rate for 0-based `step` of `total`: linear warm-up over the first `warmup` share of
    steps, then constant or a cosine decay that reaches 0 after the last step. A pure function
    of the step, so a resumed run continues on the same curve."""
    ramp = math.ceil(warmup * total)
    if step < ramp:
        return lr * (step + 1) / ramp
    if schedule == "constant":
        return lr
    if schedule != "cosine":
        raise ValueError(f"unknown lr schedule {schedule!r}")
    progress = (step - ramp) / max(1, total - ramp)  # 0 at the first decaying step, 1 after the last
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))
