"""Teacher targets: top-k next-token log-probabilities of the model with the chunk in context.

Per supervised position keep the top-k entries in descending order up to and
including the one at which cumulative probability reaches `mass` (all k when it
never does). Log-probabilities are NOT renormalized. Only supervised rows go
through the output head.
"""

from __future__ import annotations

import torch

from cartridges.models import backbone, project


def truncate_topk(logits: torch.Tensor, k: int, mass: float) -> list[tuple[list[int], list[float]]]:
    """Rows of `[N, V]` logits -> (ids, logprobs) kept per row."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    reached = values.exp().cumsum(-1) >= mass
    keep = torch.where(reached.any(-1), reached.float().argmax(-1) + 1, values.shape[-1])
    return [(ids[n, : keep[n]].tolist(), values[n, : keep[n]].tolist()) for n in range(logits.shape[0])]


@torch.no_grad()
def teacher_targets(
    model: torch.nn.Module, sequences: list[list[int]], starts: list[int], k: int = 20, mass: float = 0.99,
) -> list[list[tuple[list[int], list[float]]]]:
    """For each sequence, targets for tokens `start..end` (read from rows `start-1..end-1`).

    Each sequence runs alone through the backbone with the model's own causal
    attention: no compute spent on padding, and no explicit mask, so attention can
    take its causal fast path.
    """
    device = next(model.parameters()).device
    body = backbone(model)
    out = []
    for seq, start in zip(sequences, starts, strict=True):
        if not 1 <= start < len(seq):
            raise ValueError(f"supervised start {start} outside sequence of length {len(seq)}")
        hidden = body(input_ids=torch.tensor([seq], device=device), use_cache=False).last_hidden_state[0]
        out.append(truncate_topk(project(model, hidden[start - 1 : len(seq) - 1]), k, mass))
    return out
