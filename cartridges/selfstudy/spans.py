"""Rules shared by every planner of document spans: keyed seeds, tiling, coverage, the held-out tail."""

from __future__ import annotations

import hashlib
import itertools
import math
import random
from collections.abc import Iterable, Mapping

HELDOUT_FRAC = 0.1


def keyed_seed(*key: object) -> int:
    """A non-negative int64 seed for one item, from its key (independent of any running stream)."""
    digest = hashlib.sha256(":".join(str(k) for k in key).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def heldout_reserve(tokens: int, chunk_min: int, heldout: int) -> int:
    """Tokens at the end of a document kept for held-out chunks; 0 when it cannot spare them.

    ``max(ceil(HELDOUT_FRAC * tokens), chunk_min)``, taken only when at least
    ``chunk_min`` tokens remain for training; nothing when ``heldout`` is 0.
    """
    if heldout == 0:
        return 0
    want = max(math.ceil(HELDOUT_FRAC * tokens), chunk_min)
    return want if tokens - want >= chunk_min else 0


def tile(tokens: int, chunk_min: int, chunk_max: int, rng: random.Random) -> list[tuple[int, int]]:
    """Spans laid end to end over ``[0, tokens)`` from a random offset: every token is in one.

    Sizes are drawn in ``chunk_min..chunk_max`` (capped at ``tokens``). The grid starts ``offset`` tokens
    before the document (``offset`` uniform below the first size); the first and last
    spans are shifted inside the document, keeping their size, so they overlap their
    neighbours a little instead of being cut short. A document no longer than the
    first size is one span. At most ``1 + ceil((tokens - 1) / chunk_min)`` spans.
    """
    size = rng.randint(chunk_min, chunk_max)
    if size >= tokens:
        return [(0, tokens)]
    edge = -rng.randrange(size)
    out = []
    while True:
        start = max(0, min(edge, tokens - size))
        out.append((start, start + size))
        edge += size
        if edge >= tokens:
            return out
        size = min(rng.randint(chunk_min, chunk_max), tokens)


def token_coverage(lengths: Mapping[int, int], spans: Iterable[tuple[int, int, int]]) -> tuple[int, float]:
    """(min, mean) over every token of every document of how many (doc_id, start, end) spans hold it."""
    diff = {d: [0] * (n + 1) for d, n in lengths.items()}
    for doc, start, end in spans:
        diff[doc][start] += 1
        diff[doc][end] -= 1
    depths = [x for d, n in lengths.items() for x in itertools.accumulate(diff[d][:n])]
    return (min(depths), sum(depths) / len(depths)) if depths else (0, 0.0)
