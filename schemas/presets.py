"""Named budget presets over the pipeline defaults (the defaults themselves live in configs)."""

from __future__ import annotations

from schemas.configs import PipelineConfig

PRESETS: dict[str, dict] = {
    # As many conversations as 30 minutes hold on the machine at hand, the pilot run that measures
    # its speeds (about 5 minutes, once per corpus and config) included on a corpus's first run:
    # 478-596 for the three 3,000-token eval documents at 256 rows on a 2-core CPU in float32
    # (596-714 on later runs; experiments/LAB.md).
    "default": {"budget": {"minutes": 30}},
    # Fits `make demo` in ten minutes on a 2-core CPU without native bfloat16 (float32).
    "demo": {
        "chunks": {"conversations": 40, "heldout": 8, "chunk_min": 256, "chunk_max": 384},
        "synth": {"max_q": 48, "max_a": 128},
        # At 128 rows SnapKV's untrained rows answered the demo set worse than the first rows
        # (16.7% against 25.0%, docs/QUALITY.md), so the demo keeps the corpus init.
        "train": {"p": 128, "lr": 5e-3, "epochs": 2, "init": "corpus"},
    },
    # As many conversations as two hours hold on the machine at hand (a pilot run measures its
    # speeds): 2,529 for `raft.md` (2,935 tokens) at 1,024 rows on a 2-core CPU in float32,
    # about where the 256-row curve's fit passes 0.5 gold-NLL closure (docs/QUALITY.md).
    "large": {"chunks": {"heldout": 32}, "budget": {"minutes": 120}},
    # Seconds, for tests on tiny models.
    "smoke": {
        "chunks": {"conversations": 8, "heldout": 2, "chunk_min": 32, "chunk_max": 64},
        "synth": {"max_q": 12, "max_a": 16, "gen_batch": 4},
        "teacher": {"batch": 4},
        "train": {"p": 16, "accum": 2, "epochs": 1},
        # four steps on a random tiny model move the held-out loss by hundredths of a percent
        "health": {"min_heldout_drop": 0.0},
    },
}


def preset(name: str, overrides: dict | None = None) -> PipelineConfig:
    """The preset's config with per-section overrides applied (validated)."""
    from schemas.configs import ConfigError

    if name not in PRESETS:
        raise ConfigError(f"preset: unknown preset {name!r}; known: {', '.join(PRESETS)}")
    merged = {section: dict(values) for section, values in PRESETS[name].items()}
    overrides = overrides or {}
    sizes = "conversations" in overrides.get("chunks", {}) or "coverage" in overrides.get("budget", {})
    if sizes and "minutes" not in overrides.get("budget", {}):
        merged.get("budget", {}).pop("minutes", None)  # conversations given: the preset's time budget yields
    for section, values in overrides.items():
        merged.setdefault(section, {}).update(values)
    return PipelineConfig.from_dict(merged)


FLEET_PRESETS: dict[str, dict] = {
    "default": {},
    # A few minutes per document on a 2-core CPU with the default model.
    "demo": {"p": 128, "chunk_min": 256, "chunk_max": 384, "heldout": 4,
             "synth": {"max_q": 48, "max_a": 128}},
    # Seconds, for tests on tiny models.
    "smoke": {"p": 16, "budget": 2, "rotate_every": 2, "rounds": 4, "accum": 2, "warmup": 2,
              "chunk_min": 32, "chunk_max": 64, "heldout": 1, "embed_chunk": 64,
              "synth": {"max_q": 12, "max_a": 16, "gen_batch": 4, "filter": False},
              "teacher": {"batch": 4}},
}


def fleet_preset(name: str, overrides: dict | None = None):
    """A fleet preset with field overrides applied (nested sections merge)."""
    from schemas.configs import ConfigError, FleetConfig

    if name not in FLEET_PRESETS:
        raise ConfigError(f"fleet preset: unknown preset {name!r}; known: {', '.join(FLEET_PRESETS)}")
    merged = {k: (dict(v) if isinstance(v, dict) else v) for k, v in FLEET_PRESETS[name].items()}
    for key, value in (overrides or {}).items():
        if isinstance(value, dict):
            merged.setdefault(key, {}).update(value)
        else:
            merged[key] = value
    return FleetConfig.from_dict(merged)
