"""Typed stage configs with their defaults in one place.

Configs are frozen so a stage cannot mutate what was fingerprinted, and they
validate on construction so a bad value fails before any work starts.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, ClassVar, Self

# The paper's diverse seed forms: the default set.
SEED_TYPES: tuple[str, ...] = (
    "structuring", "summarization", "question", "use_case", "creative", "mechanism", "verbatim",
)
# Seeds that each ask for one specific detail of the chunk (docs/QUALITY.md, 10x levers).
FACT_SEED_TYPES: tuple[str, ...] = ("fact_number", "fact_name", "fact_condition", "fact_cause", "fact_contrast")
KNOWN_SEED_TYPES: tuple[str, ...] = SEED_TYPES + FACT_SEED_TYPES
INITS: tuple[str, ...] = ("auto", "corpus", "snapkv", "snapkv_questions", "random")
HELDOUT_REGIONS: tuple[str, ...] = ("sample", "tail")
LR_SCHEDULES: tuple[str, ...] = ("constant", "cosine")
TEACHER_CONTEXTS: tuple[str, ...] = ("chunk", "document")


class ConfigError(ValueError):
    """A config value is invalid; the message names the field and the value."""


def _bad(cfg: object, name: str, why: str) -> ConfigError:
    value = getattr(cfg, name)
    return ConfigError(f"{type(cfg).__name__}.{name}: {why} (got {value!r})")


_ADDED = "added"
_SAME = "same_artifact"


def option(default: Any, help: str, **how: Any) -> Any:
    """A field the command line sets (cli/options.py): the flag is `--name` with `_` as `-`, its
    type the annotation, its help `help` with the default; see `_option` for `how`."""
    return dataclasses.field(default=default, metadata=_option(help, **how))


def added(default: Any, before: Any = None, **how: Any) -> Any:
    """A field added after artifacts were made with the config. At `before` (the behaviour from
    before the field existed; `default` unless given) it stays out of the fingerprint, so those
    artifacts are still reused; the default may since have moved on to a better setting.
    `help=...` (and `option`'s other keywords) also makes it a command-line option."""
    metadata = {_ADDED: True, "before": default if before is None else before}
    return dataclasses.field(default=default, metadata=metadata | (_option(**how) if how else {}))


def _option(help: str, *, choices: tuple[str, ...] | None = None, flag: str | None = None,
            ablation: bool = False, same_artifact: bool = False) -> dict[str, Any]:
    """An option's metadata. `choices`: the values a string takes; `flag`: a name other than the
    field's; `ablation`: only quality experiments (experiments/LAB.md) set it, so the flag parses
    but stays out of `--help`, and the field stays settable in config dicts and presets;
    `same_artifact`: it sets how the work runs, not what it makes (see `fingerprint_dict`)."""
    return {"help": help, "choices": choices, "flag": flag, "ablation": ablation, _SAME: same_artifact}


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

    def fingerprint_dict(self) -> dict[str, Any]:
        """`to_dict` with each `same_artifact` field at its default: a rerun that only changes one
        (say, to checkpoint a long training that the first run did not) reuses or resumes the
        artifact instead of starting a new one."""
        out = self.to_dict()
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if f.metadata.get(_SAME) and f.name in out:
                out[f.name] = _jsonable(f.default)
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
    # The size without a time budget; the default preset sizes it by minutes (schemas/presets.py)
    conversations: int = option(1000, "self-study conversations to train on")
    heldout: int = option(16, "held-out conversations, scored before and after training")
    chunk_min: int = option(256, "shortest chunk, in tokens")
    chunk_max: int = option(512, "longest chunk, in tokens")
    seed: int = option(7, "seed of the chunk plan")
    seed_types: tuple[str, ...] = option(SEED_TYPES, "bot A's seed prompts, comma-separated, drawn in turn for "
                                         f"each chunk's conversations; known: {', '.join(KNOWN_SEED_TYPES)}")
    per_chunk: int = option(7, "conversations per chunk, each with its own seed type; they share one prefill")
    # "sample": held-out spans drawn anywhere, no text withheld from training; "tail": a reserved
    # tail of each document is held out (a diagnostic of transfer to unseen text)
    heldout_region: str = option("sample", "where held-out chunks come from: anywhere (sample), or each "
                                 "document's reserved tail (tail, a diagnostic)",
                                 choices=HELDOUT_REGIONS, ablation=True)

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
        unknown = [s for s in self.seed_types if s not in KNOWN_SEED_TYPES]
        if unknown:
            raise _bad(self, "seed_types", f"unknown {unknown}; choose from {list(KNOWN_SEED_TYPES)}")
        if len(set(self.seed_types)) != len(self.seed_types):
            raise _bad(self, "seed_types", "contains duplicates")


@dataclasses.dataclass(frozen=True)
class SynthConfig(_Config):
    max_q: int = option(64, "token budget of bot A's message")
    max_a: int = option(160, "token budget of bot B's answer")
    temperature_a: float = option(0.6, "bot A's sampling temperature")
    # Bot A's nucleus: SmolLM2's model card samples at temperature 0.2 with top-p 0.9; the
    # quality lever table (docs/QUALITY.md) measures that setting against the default.
    top_p_a: float = added(1.0, help="bot A's nucleus (top-p) cut; 1: off")
    gen_batch: int = option(64, "conversations generated in lockstep (per group and per synthesis shard)")
    seed: int = option(7, "seed of sampling")
    filter: bool = option(True, "drop conversations whose bot A or bot B message is degenerate")
    # seeds that ask a question
    stop_at_question: bool = option(True, "end bot A's message at its first '?'", ablation=True)
    # Bot B keeps the top-k log-probabilities of every answer step: exactly the teacher's
    # targets (same model, same context, same tokens), so the teacher pass reads them
    # instead of running the answers again. 0: the teacher pass computes them.
    keep_topk: int = option(20, "top-k log-probabilities bot B keeps per answer token for the teacher "
                                "(0: the teacher runs its own forward)")
    # Bot B verifies up to this many prompt-lookup draft tokens per step (greedy, so the
    # same answers). Off by default: it does not pay in wide CPU batches (docs/BENCHMARKS.md).
    spec_b: int = added(0, help="prompt-lookup draft tokens bot B verifies per step (0: off; same answers)")
    # Each conversation's bot A is shown one sentence of its chunk to ask about, consecutive
    # conversations about a span taking consecutive sentences: questions spread over the
    # chunk's facts instead of the few bot A would pick (fact coverage, docs/QUALITY.md).
    focus: bool = added(True, before=False, ablation=True,
                        help="show bot A one sentence of its chunk to ask about (consecutive per chunk)")
    # What bot B (whose answer distributions are the teacher's targets) sees: the conversation's
    # chunk, as in the paper, or the chunk's whole document, as the in-context arm of the eval
    # does (a document must then fit the model's context beside the conversation).
    teacher_context: str = added("chunk", choices=TEACHER_CONTEXTS, ablation=True,
                                 help="what bot B answers from: the chunk, or its whole document")

    # Multi-turn self-study (the paper's k): a conversation goes on for this many turns, bot A
    # asking afresh about the chunk and bot B answering behind the exchange so far; every
    # assistant turn is supervised.
    turns: int = added(1, ablation=True, help="turns per self-study conversation, each answer supervised")

    def validate(self) -> None:
        if self.teacher_context not in TEACHER_CONTEXTS:
            raise _bad(self, "teacher_context", f"must be one of {list(TEACHER_CONTEXTS)}")
        for name in ("max_q", "max_a", "gen_batch"):
            if getattr(self, name) < 1:
                raise _bad(self, name, "must be >= 1")
        if not 1 <= self.turns <= 4:
            raise _bad(self, "turns", "must be in [1, 4]")
        if not 0 <= self.keep_topk <= 1000:
            raise _bad(self, "keep_topk", "must be in [0, 1000]")
        if not 0 <= self.spec_b <= 16:
            raise _bad(self, "spec_b", "must be in [0, 16]")
        if not 0 < self.temperature_a <= 2:
            raise _bad(self, "temperature_a", "must be in (0, 2]")
        if not 0 < self.top_p_a <= 1:
            raise _bad(self, "top_p_a", "must be in (0, 1]")
        if self.seed < 0:
            raise _bad(self, "seed", "must be >= 0")


@dataclasses.dataclass(frozen=True)
class TeacherConfig(_Config):
    top_k: int = option(20, "teacher targets kept per answer token (top-k)")
    top_mass: float = option(0.99, "teacher targets cut at this probability mass")
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
    # docs/QUALITY.md, levers: closure rose with rows (256, 512, 1,024) on each document tried
    p: int = option(1024, "cartridge rows (KV-cache prefix length)")
    # None: the init's own (cartridges.core.cartridge.default_frozen): half of p under snapkv, else 1
    frozen: int | None = option(None, "leading rows held constant (default: half of p under snapkv, else 1)")
    lr: float = option(2e-2, "learning rate")  # docs/QUALITY.md, levers: lowest held-out loss of 2e-3, 2e-2 and 5e-2
    accum: int = option(4, "conversations per optimizer step")
    # at 1,000 conversations 4 epochs gave the same gold-NLL closure in twice the time
    epochs: int = option(2, "passes over the training conversations")
    schedule: str = added("constant", choices=LR_SCHEDULES, ablation=True,
                          help="learning rate: constant, or cosine decay to 0 at the last step")
    warmup: float = added(0.0, ablation=True, help="share of all steps spent ramping the learning rate up from 0")
    average: float = added(0.0, ablation=True, help="share of the last steps whose rows are averaged into "
                           "the saved cartridge (0: the rows after the last step)")
    # cartridges.core.cartridge.resolve_init
    init: str = option("auto", "the rows' start: snapkv where the model allows it, else corpus (auto); the "
                       "corpus's first p tokens (corpus); rows SnapKV picks over the corpus, observed from its "
                       "tail (snapkv) or from self-study's questions (snapkv_questions); random",
                       choices=INITS)
    pack: bool = option(True, "train a group's conversations in one packed forward/backward")
    checkpoint: bool = option(False, "recompute activations in the backward (less memory, more time)")
    draft_ref: bool = added(False, help="embed the corpus token ids in the cartridge file (drafts for serve --spec)")
    save_every: int = option(0, "write a training checkpoint every N steps (0: never)", same_artifact=True)
    seed: int = option(7, "seed of the training order")

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
        if not 0 <= self.average <= 1:
            raise _bad(self, "average", "must be in [0, 1] (a share of all steps)")
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

    min_heldout_drop: float = option(0.01, "health check: the least relative fall of the held-out loss")
    diverge_ratio: float = 1.25  # last tenth of the loss curve over its first tenth

    def validate(self) -> None:
        if not -1 <= self.min_heldout_drop < 1:
            raise _bad(self, "min_heldout_drop", "must be in [-1, 1)")
        if self.diverge_ratio <= 1:
            raise _bad(self, "diverge_ratio", "must be > 1")


@dataclasses.dataclass(frozen=True)
class BudgetConfig(_Config):
    """Budgets that follow the corpus or the machine: set, they fix `train.p` and
    `chunks.conversations` before the run starts (the stages see, and fingerprint, the numbers)."""

    compression: float | None = option(None, "corpus tokens per cartridge row: sets --p from the corpus "
                                             "(10: ten times fewer rows than the corpus has tokens)")
    coverage: float | None = option(None, "training spans over each corpus token, on average: sets "
                                          "--conversations from the corpus (the summary's coverage mean)")
    minutes: float | None = option(None, "wall-clock minutes for the run on this machine: sets --conversations "
                                         "from speeds a short pilot run measures here (once per config)")

    def validate(self) -> None:
        for name in ("compression", "coverage", "minutes"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise _bad(self, name, "must be > 0")
        if self.coverage is not None and self.minutes is not None:
            raise _bad(self, "minutes", "both it and coverage set the conversations; give one")


@dataclasses.dataclass(frozen=True)
class PipelineConfig(_Config):
    ingest: IngestConfig = dataclasses.field(default_factory=IngestConfig)
    chunks: ChunkConfig = dataclasses.field(default_factory=ChunkConfig)
    synth: SynthConfig = dataclasses.field(default_factory=SynthConfig)
    teacher: TeacherConfig = dataclasses.field(default_factory=TeacherConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    health: HealthConfig = dataclasses.field(default_factory=HealthConfig)
    budget: BudgetConfig = dataclasses.field(default_factory=BudgetConfig)


DISTRACTOR_MODES: tuple[str, ...] = ("train", "frozen")
TARGET_MODES: tuple[str, ...] = ("tokens", "balanced")


@dataclasses.dataclass(frozen=True)
class FleetConfig(_Config):
    """A fleet: one cartridge per document, trained jointly under a residency budget."""

    # cartridges
    p: int = option(256, "rows per cartridge")
    frozen: int = option(1, "leading rows of each cartridge held constant")
    # budget manager
    budget: int = option(4, "cartridges resident in memory at a time")
    rotate_every: int = option(10, "rounds between rotations of the residents")
    evict_frac: float = option(0.5, "share of the residents (most-trained first) swapped out at a rotation")
    warmup: int = option(8, "steps over which each cartridge ramps its learning rate up")
    # mixed visibility
    p_iso: float = option(0.75, "chance that a round's target is the only prefix (else distractors are co-loaded)")
    distract_max: int = option(3, "most distractors co-loaded in a round")
    distractors: str = option("train", "co-loaded distractors take optimizer steps (train) or stay constant (frozen)",
                              choices=DISTRACTOR_MODES, ablation=True)
    targets: str = option("tokens", "round targets drawn proportional to tokens (tokens), or the least-trained "
                          "resident (balanced)", choices=TARGET_MODES)
    # rounds of self-study: one optimizer group of `accum` conversations per round
    rounds: int = option(20, "rounds of self-study, one optimizer step each")
    accum: int = option(4, "conversations per round")
    lr: float = option(2e-3, "learning rate")
    pack: bool = option(True, "train a round's conversations in one packed forward/backward")
    chunk_min: int = option(256, "shortest chunk, in tokens")
    chunk_max: int = option(512, "longest chunk, in tokens")
    heldout: int = option(4, "held-out conversations per document")
    seed: int = option(7, "seed of the round plans and held-out conversations")
    # retrieval
    embed_chunk: int = option(256, "tokens per retrieval chunk")
    rag_docs: int = option(2, "documents composed per question")
    rag_chunks: int = option(8, "chunks retrieved per question (at least rag_docs)")
    # the sections' options the fleet command shows (cli/options.py)
    synth: SynthConfig = dataclasses.field(
        default_factory=SynthConfig, metadata={"options": ("max_q", "max_a", "gen_batch", "temperature_a", "top_p_a", "filter")})
    teacher: TeacherConfig = dataclasses.field(default_factory=TeacherConfig,
                                               metadata={"options": ("top_k", "top_mass")})
    ingest: IngestConfig = dataclasses.field(default_factory=IngestConfig, metadata={"options": ()})

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
