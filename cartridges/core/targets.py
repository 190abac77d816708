"""Teacher targets: top-k next-token log-probabilities of the model with the chunk in context.

Per supervised position keep the top-k entries in descending order up to and
including the one at which cumulative probability reaches `mass` (all k when it
never does). Log-probabilities are NOT renormalized. Only supervised rows go
through the output head.
"""

from __future__ import annotations

import torch

from cartridges.core.models import backbone, project
from cartridges.core.prefix import capture_rows, forward_behind
from cartridges.core.sharing import shared_groups


def top_entries(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `[N, V]` logits -> the k largest float32 log-probabilities and their ids, descending."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.topk(min(k, logp.shape[-1]), dim=-1)


def truncate_topk(logits: torch.Tensor, k: int, mass: float) -> list[tuple[list[int], list[float]]]:
    """Rows of `[N, V]` logits -> (ids, logprobs) kept per row."""
    return cut_at_mass(*top_entries(logits, k), mass)


def cut_at_mass(values: torch.Tensor, ids: torch.Tensor, mass: float) -> list[tuple[list[int], list[float]]]:
    """Descending `[N, k]` entries -> each row's prefix up to where cumulative probability reaches `mass`.

    Applied to the first k' <= k columns of stored top-k entries it keeps exactly what
    `truncate_topk(logits, k', mass)` keeps: the same float32 numbers, the same ops.
    """
    reached = values.exp().cumsum(-1) >= mass
    keep = torch.where(reached.any(-1), reached.float().argmax(-1) + 1, values.shape[-1])
    return [(ids[n, : keep[n]].tolist(), values[n, : keep[n]].tolist()) for n in range(values.shape[0])]


@torch.no_grad()
def teacher_targets(
    model: torch.nn.Module, sequences: list[list[int]], starts: list[int], k: int = 20, mass: float = 0.99,
    share_min: int = 0,
) -> list[list[tuple[list[int], list[float]]]]:
    """For each sequence, targets for tokens `start..end` (read from rows `start-1..end-1`).

    A sequence runs alone through the backbone with the model's own causal attention:
    no compute spent on padding, and no explicit mask, so attention can take its causal
    fast path. With `share_min > 0`, sequences that start with at least that many common
    tokens (conversations about one chunk) prefill them once, and each runs only its own
    tail behind the captured rows.
    """
    device = next(model.parameters()).device
    body = backbone(model)
    for seq, start in zip(sequences, starts, strict=True):
        if not 1 <= start < len(seq):
            raise ValueError(f"supervised start {start} outside sequence of length {len(seq)}")
    out: list = [None] * len(sequences)
    groups = (shared_groups(sequences, share_min, [s - 1 for s in starts]) if share_min
              else [(0, [i]) for i in range(len(sequences))])
    for length, members in groups:
        head = capture_rows(model, torch.tensor(sequences[members[0]][:length], device=device)) if length else None
        for i in members:
            seq, start = sequences[i], starts[i]
            ids = torch.tensor([seq[length:]], device=device)
            if head is None:
                hidden = body(input_ids=ids, use_cache=False).last_hidden_state[0]
            else:
                hidden = forward_behind(model, head, ids)[0]
            out[i] = truncate_topk(project(model, hidden[start - 1 - length : len(seq) - 1 - length]), k, mass)
    return out
