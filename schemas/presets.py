"""Named budget presets over the pipeline defaults (the defaults themselves live in configs)."""

from __future__ import annotations

from schemas.configs import PipelineConfig

PRESETS: dict[str, dict] = {
    "default": {},
    # Fits `make demo` (about ten minutes on a 2-core CPU with the default model).
    "demo": {
        "chunks": {"conversations": 64, "heldout": 8, "chunk_min": 256, "chunk_max": 384},
        "synth": {"max_q": 48, "max_a": 128},
        "train": {"p": 128, "lr": 5e-3, "epochs": 2},
    },
    # Seconds, for tests on tiny models.
    "smoke": {
        "chunks": {"conversations": 8, "heldout": 2, "chunk_min": 32, "chunk_max": 64},
        "synth": {"max_q": 12, "max_a": 16, "gen_batch": 4},
        "teacher": {"batch": 4},
        "train": {"p": 16, "accum": 2},
    },
}


def preset(name: str, overrides: dict | None = None) -> PipelineConfig:
    """The preset's config with per-section overrides applied (validated)."""
    from schemas.configs import ConfigError

    if name not in PRESETS:
        raise ConfigError(f"preset: unknown preset {name!r}; known: {', '.join(PRESETS)}")
    merged = {section: dict(values) for section, values in PRESETS[name].items()}
    for section, values in (overrides or {}).items():
        merged.setdefault(section, {}).update(values)
    return PipelineConfig.from_dict(merged)
