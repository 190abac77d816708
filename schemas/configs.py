"""Typed stage configs with their defaults in one place.

Configs are frozen so a stage cannot mutate what was fingerprinted, and they
validate on construction so a bad value fails before any work starts.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, ClassVar, Self

SEED_TYPES: tuple[str, ...] = (
    "structuring", "summarization", "question", "use_case", "creative", "mechanism", "verbatim",
)
INITS: tuple[str, ...] = ("auto", "corpus", "snapkv", "random")
HELDOUT_REGIONS: tuple[str, ...] = ("sample", "tail")
LR_SCHEDULES: tuple[str, ...] = ("constant", "cosine")
TEACHER_CONTEXTS: tuple[str, ...] = ("chunk", "document")


class ConfigError(ValueError):
    """A config value is invalid; the message names the field and the value."""


def _bad(cfg: object, name: str, why: str) -> ConfigError:
    value = getattr(cfg, name)
    return ConfigError(f"{type(cfg).__name__}.{name}: {why} (got {value!r})")


_ADDED = "added"


def added(default: Any, before: Any = None) -> Any:
    """A field added after artifacts were made with the config. At `before` (the behaviour from
    before the field existed; `default` unless given) it stays out of the fingerprint, so those
    artifacts are still reused; the default may since have moved on to a better setting."""
    return dataclasses.field(default=default, metadata={_ADDED: True, "before": default if before is None else before})


class _Config:
    """Shared behaviour: type coercion, validation hook, dict round trip."""

    VERSION: ClassVar[int] = 1

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            fixed = _coerce(self, f.name, hints[f.name], value)
            if fixed is not value:
                object.__setattr__(self, f.name, fixed)
        self.validate()

    def validate(self) -> None:
        """Subclasses raise ConfigError here; types are already checked."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe, key-sorted dict; the form that gets fingerprinted. An `added` field at its
        `before` value is left out, so artifacts made before it existed keep their fingerprints."""
        out: dict[str, Any] = {}
        for f in sorted(dataclasses.fields(self), key=lambda f: f.name):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.metadata.get(_ADDED) and value == f.metadata["before"]:
                continue
            out[f.name] = _jsonable(value)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """Build from a dict such as ``to_dict()`` produced; unknown keys are an error."""
        if not isinstance(data, dict):
            raise ConfigError(f"{cls.__name__}: expected a mapping, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(
                f"{cls.__name__}: unknown field(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(names))}"
            )
        return cls(**data)

    def replace(self, **changes: Any) -> Self:
        """A validated copy with ``changes`` applied."""
        names = {f.name for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ConfigError(f"{type(self).__name__}: unknown field(s) {', '.join(unknown)}")
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


def _jsonable(value: Any) -> Any:
    if isinstance(value, _Config):
        return value.to_dict()
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    return value


def _coerce(cfg: object, name: str, hint: Any, value: Any) -> Any:
    """Check a field against its annotation; accept int for float and list for tuple."""
    args = typing.get_args(hint)
    if type(None) in args and len(args) == 2:  # `X | None`: None, or what X accepts
        return None if value is None else _coerce(cfg, name, next(a for a in args if a is not type(None)), value)
    if isinstance(hint, type) and issubclass(hint, _Config):
        if isinstance(value, hint):
            return value
        if isinstance(value, dict):
            try:
                return hint.from_dict(value)
            except ConfigError as e:
                raise ConfigError(f"{type(cfg).__name__}.{name}: {e}") from e
        raise _bad(cfg, name, f"expected {hint.__name__} or a mapping")
    if hint is bool:
        if not isinstance(value, bool):
            raise _bad(cfg, name, "expected a bool")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(cfg, name, "expected an int")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _bad(cfg, name, "expected a number")
        if not math.isfinite(value):
            raise _bad(cfg, name, "expected a finite number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise _bad(cfg, name, "expected a string")
        return value
    if typing.get_origin(hint) is tuple:
        if isinstance(value, str) or not isinstance(value, tuple | list):
            raise _bad(cfg, name, "expected a list of strings")
        if not all(isinstance(v, str) for v in value):
            raise _bad(cfg, name, "expected a list of strings")
        return tuple(value)
    return value


@dataclasses.dataclass(frozen=True)
class IngestConfig(_Config):
    max_bytes: int = 16 * 1024 * 1024
    extensions: tuple[str, ...] = (".md", ".txt")

    def validate(self) -> None:
        if self.max_bytes < 1:
            raise _bad(self, "max_bytes", "must be >= 1")
        if not self.extensions:
            raise _bad(self, "extensions", "must not be empty")
        if not all(e.startswith(".") and len(e) > 1 for e in self.extensions):
            raise _bad(self, "extensions", "each extension must look like '.md'")


@dataclasses.dataclass(frozen=True)
class ChunkConfig(_Config):
    conversations: int = 1000  # docs/QUALITY.md: about 20 minutes for a 3,000-token document, 2 epochs
    heldout: int = 16
    chunk_min: int = 256
    chunk_max: int = 512
    seed: int = 7
    seed_types: tuple[str, ...] = SEED_TYPES
    per_chunk: int = 7  # conversations (distinct seed types) per span, its prefill shared
    # "sample": held-out spans drawn anywhere, no text withheld from training; "tail": a reserved
    # tail of each document is held out (a diagnostic of transfer to unseen text)
    heldout_region: str = "sample"

    def validate(self) -> None:
        if self.heldout_region not in HELDOUT_REGIONS:
            raise _bad(self, "heldout_region", f"must be one of {list(HELDOUT_REGIONS)}")
        if self.conversations < 1:
            raise _bad(self, "conversations", "must be >= 1")
        if self.per_chunk < 1:
            raise _bad(self, "per_chunk", "must be >= 1")
        if self.heldout < 0:
            raise _bad(self, "heldout", "must be >= 0")
        if self.chunk_min < 16:
            raise _bad(self, "chunk_min", "must be >= 16")
        if self.chunk_max < self.chunk_min:
            raise _bad(self, "chunk_max", f"must be >= chunk_min ({self.chunk_min})")
        if self.seed < 0:
            raise _bad(self, "seed", "must be >= 0")
        if not self.seed_types:
            raise _bad(self, "seed_types", "must not be empty")
        unknown = [s for s in self.seed_types if s not in SEED_TYPES]
        if unknown:
            raise _bad(self, "seed_types", f"unknown {unknown}; choose from {list(SEED_TYPES)}")
        if len(set(self.seed_types)) != len(self.seed_types):
            raise _bad(self, "seed_types", "contains duplicates")


@dataclasses.dataclass(frozen=True)
class SynthConfig(_Config):
    max_q: int = 64
    max_a: int = 160
    temperature_a: float = 0.6
    gen_batch: int = 64  # lockstep streams per generation group and per synthesis shard
    seed: int = 7
    filter: bool = True
    stop_at_question: bool = True  # end bot A's message at its first '?' (seeds that ask a question)
    # Bot B keeps the top-k log-probabilities of every answer step: exactly the teacher's
    # targets (same model, same context, same tokens), so the teacher pass reads them
    # instead of running the answers again. 0: the teacher pass computes them.
    keep_topk: int = 20
    # Bot B verifies up to this many prompt-lookup draft tokens per step (greedy, so the
    # same answers). Off by default: it does not pay in wide CPU batches (docs/BENCHMARKS.md).
    spec_b: int = added(0)
    # Each conversation's bot A is shown one sentence of its chunk to ask about, consecutive
    # conversations about a span taking consecutive sentences: questions spread over the
    # chunk's facts instead of the few bot A would pick (fact coverage, docs/QUALITY.md).
    focus: bool = added(True, before=False)
    # What bot B (whose answer distributions are the teacher's targets) sees: the conversation's
    # chunk, as in the paper, or the chunk's whole document, as the in-context arm of the eval
    # does (a document must then fit the model's context beside the conversation).
    teacher_context: str = added("chunk")

    def validate(self) -> None:
        if self.teacher_context not in TEACHER_CONTEXTS:
            raise _bad(self, "teacher_context", f"must be one of {list(TEACHER_CONTEXTS)}")
        for name in ("max_q", "max_a", "gen_batch"):
            if getattr(self, name) < 1:
                raise _bad(self, name, "must be >= 1")
        if not 0 <= self.keep_topk <= 1000:
            raise _bad(self, "keep_topk", "must be in [0, 1000]")
        if not 0 <= self.spec_b <= 16:
            raise _bad(self, "spec_b", "must be in [0, 16]")
        if not 0 < self.temperature_a <= 2:
            raise _bad(self, "temperature_a", "must be in (0, 2]")
        if self.seed < 0:
            raise _bad(self, "seed", "must be >= 0")


@dataclasses.dataclass(frozen=True)
class TeacherConfig(_Config):
    top_k: int = 20
    top_mass: float = 0.99
    batch: int = 8

    def validate(self) -> None:
        if not 1 <= self.top_k <= 1000:
            raise _bad(self, "top_k", "must be in [1, 1000]")
        if not 0 < self.top_mass <= 1:
            raise _bad(self, "top_mass", "must be in (0, 1]")
        if self.batch < 1:
            raise _bad(self, "batch", "must be >= 1")


@dataclasses.dataclass(frozen=True)
class TrainConfig(_Config):
    p: int = 1024  # docs/QUALITY.md, levers: closure rose with rows (256, 512, 1,024) on each document tried
    # None: the init's own (cartridges.core.cartridge.default_frozen): half of p under snapkv, else 1
    frozen: int | None = None
    lr: float = 2e-2  # docs/QUALITY.md, levers: lowest held-out loss of 2e-3, 2e-2 and 5e-2
    accum: int = 4
    epochs: int = 2  # at 1,000 conversations 4 epochs gave the same gold-NLL closure in twice the time
    schedule: str = added("constant")  # or "cosine": linear warm-up, then cosine decay to 0 at the last step
    warmup: float = added(0.0)  # share of all steps spent warming up linearly from 0 (any schedule)
    init: str = "auto"  # snapkv where the model allows it, else corpus (cartridges.core.cartridge.resolve_init)
    pack: bool = True
    checkpoint: bool = False
    draft_ref: bool = added(False)  # embed the corpus token ids in the file: serve --spec drafts from them
    save_every: int = 0
    seed: int = 7

    def validate(self) -> None:
        if self.p < 1:
            raise _bad(self, "p", "must be >= 1")
        if self.frozen is not None and not 0 <= self.frozen < self.p:
            raise _bad(self, "frozen", f"must be in [0, p) with p={self.p}")
        if self.lr <= 0:
            raise _bad(self, "lr", "must be > 0")
        if self.accum < 1:
            raise _bad(self, "accum", "must be >= 1")
        if self.epochs < 1:
            raise _bad(self, "epochs", "must be >= 1")
        if self.init not in INITS:
            raise _bad(self, "init", f"must be one of {list(INITS)}")
        if self.schedule not in LR_SCHEDULES:
            raise _bad(self, "schedule", f"must be one of {list(LR_SCHEDULES)}")
        if not 0 <= self.warmup < 1:
            raise _bad(self, "warmup", "must be in [0, 1) (a share of all steps)")
        if self.save_every < 0:
            raise _bad(self, "save_every", "must be >= 0 (0 disables)")
        if self.seed < 0:
            raise _bad(self, "seed", "must be >= 0")


@dataclasses.dataclass(frozen=True)
class HealthConfig(_Config):
    """The training health check's bars (not part of any stage's fingerprint)."""

    min_heldout_drop: float = 0.01  # relative; a run whose held-out loss falls less has failed
    diverge_ratio: float = 1.25  # last tenth of the loss curve over its first tenth

    def validate(self) -> None:
        if not -1 <= self.min_heldout_drop < 1:
            raise _bad(self, "min_heldout_drop", "must be in [-1, 1)")
        if self.diverge_ratio <= 1:
            raise _bad(self, "diverge_ratio", "must be > 1")


@dataclasses.dataclass(frozen=True)
class PipelineConfig(_Config):
    ingest: IngestConfig = dataclasses.field(default_factory=IngestConfig)
    chunks: ChunkConfig = dataclasses.field(default_factory=ChunkConfig)
    synth: SynthConfig = dataclasses.field(default_factory=SynthConfig)
    teacher: TeacherConfig = dataclasses.field(default_factory=TeacherConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    health: HealthConfig = dataclasses.field(default_factory=HealthConfig)


DISTRACTOR_MODES: tuple[str, ...] = ("train", "frozen")
TARGET_MODES: tuple[str, ...] = ("tokens", "balanced")


@dataclasses.dataclass(frozen=True)
class FleetConfig(_Config):
    """A fleet: one cartridge per document, trained jointly under a residency budget."""

    # cartridges
    p: int = 256
    frozen: int = 1
    # budget manager
    budget: int = 4
    rotate_every: int = 10
    evict_frac: float = 0.5
    warmup: int = 8
    # mixed visibility
    p_iso: float = 0.75
    distract_max: int = 3
    distractors: str = "train"
    targets: str = "tokens"  # "tokens": drawn proportional to tokens; "balanced": least-trained
    # rounds of self-study: one optimizer group of `accum` conversations per round
    rounds: int = 20
    accum: int = 4
    lr: float = 2e-3
    pack: bool = True
    chunk_min: int = 256
    chunk_max: int = 512
    heldout: int = 4  # held-out conversations per document
    seed: int = 7
    # retrieval
    embed_chunk: int = 256
    rag_docs: int = 2
    rag_chunks: int = 8
    synth: SynthConfig = dataclasses.field(default_factory=SynthConfig)
    teacher: TeacherConfig = dataclasses.field(default_factory=TeacherConfig)
    ingest: IngestConfig = dataclasses.field(default_factory=IngestConfig)

    def validate(self) -> None:
        if self.p < 1:
            raise _bad(self, "p", "must be >= 1")
        if not 0 <= self.frozen < self.p:
            raise _bad(self, "frozen", f"must be in [0, p) with p={self.p}")
        for name in ("budget", "rotate_every", "accum", "embed_chunk", "rag_docs", "rag_chunks"):
            if getattr(self, name) < 1:
                raise _bad(self, name, "must be >= 1")
        for name in ("warmup", "distract_max", "rounds", "heldout", "seed"):
            if getattr(self, name) < 0:
                raise _bad(self, name, "must be >= 0")
        if not 0 < self.evict_frac <= 1:
            raise _bad(self, "evict_frac", "must be in (0, 1]")
        if not 0 <= self.p_iso <= 1:
            raise _bad(self, "p_iso", "must be in [0, 1]")
        if self.distractors not in DISTRACTOR_MODES:
            raise _bad(self, "distractors", f"must be one of {list(DISTRACTOR_MODES)}")
        if self.targets not in TARGET_MODES:
            raise _bad(self, "targets", f"must be one of {list(TARGET_MODES)}")
        if self.lr <= 0:
            raise _bad(self, "lr", "must be > 0")
        if self.chunk_min < 16:
            raise _bad(self, "chunk_min", "must be >= 16")
        if self.chunk_max < self.chunk_min:
            raise _bad(self, "chunk_max", f"must be >= chunk_min ({self.chunk_min})")
        if self.rag_chunks < self.rag_docs:
            raise _bad(self, "rag_chunks", f"must be >= rag_docs ({self.rag_docs})")
