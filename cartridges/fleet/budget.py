"""The budget manager's policy: which cartridges are resident, as a pure function of step counters.

At most `budget` cartridges are resident (rows and Adam moments in memory). Every
`rotate_every` rounds, `ceil(evict_frac * residents)` of the MOST-trained residents go
to disk and as many of the LEAST-trained absentees come in; ties go to the lower doc id
on both sides. When fewer documents are absent than that, only as many are evicted as
can be replaced. Entrants ramp up under a per-cartridge lr warm-up keyed to the
cartridge's own step counter, so leaving memory and coming back changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


def initial_residents(steps: Mapping[int, int], budget: int) -> list[int]:
    """The `budget` least-trained documents (ties -> lower doc id), in doc-id order."""
    order = sorted(steps, key=lambda d: (steps[d], d))
    return sorted(order[:budget])


def rotation(
    residents: Sequence[int], steps: Mapping[int, int], evict_frac: float,
) -> tuple[list[int], list[int]]:
    """(evicted, entering) for one rotation; both lists in the order they were chosen.

    `steps` holds every document of the fleet (residents and absentees).
    """
    resident = set(residents)
    absent = [d for d in steps if d not in resident]
    wanted = math.ceil(evict_frac * len(residents))
    n = min(wanted, len(absent))
    evicted = sorted(residents, key=lambda d: (-steps[d], d))[:n]
    entering = sorted(absent, key=lambda d: (steps[d], d))[:n]
    return evicted, entering


def rotate(
    residents: Sequence[int], steps: Mapping[int, int], evict_frac: float,
) -> list[int]:
    """The resident set after one rotation, in doc-id order."""
    evicted, entering = rotation(residents, steps, evict_frac)
    return sorted((set(residents) - set(evicted)) | set(entering))


def is_rotation_round(round_index: int, rotate_every: int) -> bool:
    """Rotation happens after every `rotate_every`-th round (global round numbers, from 0)."""
    return (round_index + 1) % rotate_every == 0


def warmup_lr(lr: float, steps_done: int, warmup: int) -> float:
    """Learning rate of a cartridge's next step, from the steps it has already taken."""
    if warmup <= 0:
        return lr
    return lr * min(1.0, (steps_done + 1) / warmup)
