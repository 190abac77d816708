"""Round plans: which document is the target, what else is co-loaded, which chunks are quizzed.

A round is one optimizer group. Its plan is a pure function of (seed, round number,
residents, token counts), and every random choice inside it comes from a generator
keyed by (seed, item), never from a running stream, so a rerun or a resume reproduces
it exactly.

Mixed visibility: the target is drawn among residents with probability proportional
to its tokens (or, with `targets="balanced"`, is the least-trained resident); with probability `p_iso` it is the only prefix, otherwise 1..distract_max
other residents co-load and the target's place among them is shuffled too.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from cartridges.selfstudy.spans import heldout_reserve, keyed_seed
from schemas import SEED_TYPES, FleetConfig


@dataclass(frozen=True)
class Chunk:
    doc_id: int
    start: int
    end: int
    seed_type: str
    rng_seed: int


@dataclass(frozen=True)
class RoundPlan:
    round: int
    target: int
    parts: tuple[int, ...]  # composition order; the target is one of them
    chunks: tuple[Chunk, ...] = field(default=())

    @property
    def isolated(self) -> bool:
        return len(self.parts) == 1

    @property
    def visibility(self) -> str:
        """`isolated`, or `co-loaded:<i>` with i the target's index in `parts`."""
        return "isolated" if self.isolated else f"co-loaded:{self.parts.index(self.target)}"


def draw_chunk(doc_id: int, lo: int, hi: int, config: FleetConfig, seed: int) -> Chunk:
    """A uniform random span of chunk_min..chunk_max tokens inside [lo, hi)."""
    rng = random.Random(seed)
    size = min(rng.randint(config.chunk_min, config.chunk_max), hi - lo)
    start = lo + rng.randint(0, hi - lo - size)
    return Chunk(doc_id, start, start + size, rng.choice(SEED_TYPES), seed)


def plan_round(
    round_index: int, residents: Sequence[int], tokens: Mapping[int, int], config: FleetConfig,
    steps: Mapping[int, int] | None = None,
) -> RoundPlan:
    """The plan of one round over the current residents.

    With `targets="balanced"` the target is the least-trained resident (ties to the
    lower doc id) instead of a token-weighted draw; that needs `steps`.
    """
    if not residents:
        raise ValueError("a round needs at least one resident cartridge")
    pool = sorted(residents)
    rng = random.Random(keyed_seed(config.seed, "round", round_index))
    weighted = rng.choices(pool, weights=[max(1, tokens[d]) for d in pool])[0]
    if config.targets == "balanced":
        if steps is None:
            raise ValueError("balanced targets need the step counters")
        target = min(pool, key=lambda d: (steps[d], d))
    else:
        target = weighted
    parts = [target]
    others = [d for d in pool if d != target]
    if others and config.distract_max > 0 and rng.random() >= config.p_iso:
        k = rng.randint(1, min(config.distract_max, len(others)))
        parts += rng.sample(others, k)
        rng.shuffle(parts)
    n = tokens[target]
    train_end = n - heldout_reserve(n, config.chunk_min, config.heldout)
    chunks = tuple(
        draw_chunk(target, 0, train_end, config, keyed_seed(config.seed, "round", round_index, "chunk", i))
        for i in range(config.accum)
    )
    return RoundPlan(round_index, target, tuple(parts), chunks)


def heldout_chunks(doc_id: int, tokens: int, config: FleetConfig, salt: str = "") -> list[Chunk]:
    """The document's held-out chunks, drawn from its reserved tail (keyed by its content)."""
    reserve = heldout_reserve(tokens, config.chunk_min, config.heldout)
    if reserve == 0:
        return []
    return [
        draw_chunk(doc_id, tokens - reserve, tokens, config, keyed_seed(config.seed, "heldout", salt, i))
        for i in range(config.heldout)
    ]
