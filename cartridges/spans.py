"""Rules shared by every planner of document spans: keyed seeds and the held-out tail."""

from __future__ import annotations

import hashlib
import math

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
