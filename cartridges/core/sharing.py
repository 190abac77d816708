"""Shared leading tokens: compute a common prefix once, continue every sequence behind it.

Self-study asks several questions about one chunk, so its prompts (and its teacher
sequences) start with the same few hundred tokens. Prefilling those once and running
only each sequence's own tail behind the captured rows gives the same tokens as running
each sequence alone: the captured rows are exactly the cache a full prefill writes.
"""

from __future__ import annotations

from collections.abc import Sequence

# Heads shorter than this cost less to recompute than a separate prefill forward.
SHARE_MIN = 32


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def shared_groups(
    seqs: Sequence[Sequence[int]], min_len: int, limits: Sequence[int] | None = None,
) -> list[tuple[int, list[int]]]:
    """Group indices of `seqs` by a common prefix of at least `min_len` tokens.

    Returns `(prefix length, indices)` pairs covering every index once; an index that
    shares nothing worth computing once sits alone with prefix length 0. `limits[i]`
    caps how much of sequence i may be shared (its own tail must keep the tokens whose
    outputs are read).
    """
    caps = list(limits) if limits is not None else [len(s) for s in seqs]
    order = sorted(range(len(seqs)), key=lambda i: list(seqs[i]))
    groups: list[tuple[int, list[int]]] = []
    members: list[int] = []
    length = 0
    for i in order:
        if members:
            joined = min(length, common_length(seqs[members[-1]], seqs[i]), caps[i])
            if joined >= min_len:
                members.append(i)
                length = joined
                continue
            groups.append((length if len(members) > 1 else 0, members))
        members, length = [i], caps[i]
    if members:
        groups.append((length if len(members) > 1 else 0, members))
    return groups
