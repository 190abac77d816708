"""Sparse top-k context-distillation loss, projecting only the supervised rows.

loss = mean over supervised positions of  -sum_k exp(teacher_logprob_k) * log q(token_k)
with the student's distribution read at position - 1. Entries are the teacher's
top-k truncated at cumulative mass (not renormalized); padding ids are -1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cartridges.core.models import project
from cartridges.core.prefix import Rows, forward_behind


@dataclass
class Targets:
    """Supervised positions of a batch: row, token position, top-k ids and logprobs."""

    row: torch.Tensor  # [N] batch row
    position: torch.Tensor  # [N] index of the supervised token in its row
    ids: torch.Tensor  # [N, K] vocabulary ids, -1 = padding
    logprobs: torch.Tensor  # [N, K] teacher log-probabilities (padding ignored)

    def __len__(self) -> int:
        return int(self.row.numel())


def sparse_distill(
    hidden: torch.Tensor, model: torch.nn.Module, ids: torch.Tensor, logprobs: torch.Tensor,
    reduction: str = "mean",
) -> torch.Tensor:
    """Loss over already-selected hidden rows `[N, D]` (the student's position - 1 rows)."""
    logits = project(model, hidden)
    dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16 models: reduce in f32
    logq = torch.log_softmax(logits.to(dtype), dim=-1)
    valid = ids >= 0
    picked = logq.gather(1, ids.clamp(min=0))
    weights = torch.where(valid, logprobs.to(dtype).exp(), torch.zeros_like(picked))
    per_position = -(weights * picked).sum(-1)
    return per_position.mean() if reduction == "mean" else per_position.sum()


def student_loss(
    model: torch.nn.Module,
    rows: Rows,
    input_ids: torch.Tensor,
    targets: Targets,
    attention_mask: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    reduction: str = "mean",
    checkpoint: bool = False,
) -> torch.Tensor:
    """Distillation loss of the student behind `rows` (a cartridge or a composition)."""
    if (targets.position < 1).any():
        raise ValueError("a supervised position must be >= 1 (its logits come from position - 1)")
    hidden = forward_behind(model, rows, input_ids, attention_mask, segment_ids, checkpoint=checkpoint)
    selected = hidden[targets.row, targets.position - 1]
    return sparse_distill(selected, model, targets.ids, targets.logprobs, reduction)
