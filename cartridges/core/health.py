"""Training health check: some seeds fail outright, and their losses show it.

A run fails the check when its held-out loss did not fall clearly (by at least
`min_heldout_drop` relative), when a training loss is not finite, or when the
training loss curve ends clearly above where it started (divergence). The run is
still kept, so it can be inspected; it is recorded as failed.
"""

from __future__ import annotations

import math

from schemas.configs import HealthConfig

WINDOW = 0.1  # share of steps averaged at each end of the curve


def training_health(losses: list[float], before: float | None, after: float | None,
                    config: HealthConfig | None = None) -> str | None:
    """Why the run failed the check, or None when it passed."""
    config = config or HealthConfig()
    if any(not math.isfinite(x) for x in losses):
        return "training loss is not finite (diverged)"
    if len(losses) >= 4:
        n = max(1, round(len(losses) * WINDOW))
        first, last = sum(losses[:n]) / n, sum(losses[-n:]) / n
        if last > first * config.diverge_ratio:
            return f"training loss diverged: mean of the first {n} steps {first:.4f}, of the last {n} {last:.4f}"
    if before is not None and after is not None:
        if not math.isfinite(after):
            return "held-out loss after training is not finite (diverged)"
        drop = (before - after) / before if before else 0.0
        if drop < config.min_heldout_drop:
            return (f"held-out loss did not fall clearly: {before:.4f} -> {after:.4f} "
                    f"({-drop:+.1%}; needs a drop of at least {config.min_heldout_drop:.0%})")
    return None


def health_fields(losses: list[float], before: float | None, after: float | None,
                  config: HealthConfig | None = None) -> dict:
    """`health` ("ok" or "failed") and `health_reason` for a run summary."""
    reason = training_health(losses, before, after, config)
    return {"health": "ok" if reason is None else "failed", "health_reason": reason}
