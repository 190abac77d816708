"""The plan of a cartridge run, before the long work starts: rows, conversations, minutes.

Budgets can follow the corpus (`budget.compression`: corpus tokens per row; `budget.coverage`:
training spans over each token, on average) or the machine (`budget.minutes`: as many
conversations as fit, at the speeds a pilot run measured here; see `Rates`). The estimate
comes from this store's earlier runs of the same model on this machine (their `Rates`,
medians); with none, the plan says so rather than guess.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path

from cartridges.core.corpus import expand, read_text
from cartridges.core.errors import CartridgeError
from cartridges.core.speed import machine_id
from schemas import PipelineConfig
from storage import Store, canonical_json, sha256_bytes

PILOT = "pilot"  # the catalog flow of a pilot run
TIMED = ("synthesize", "facts", "teacher", "train")  # the stages whose times `Rates` reads


def corpus_tokens(tokenizer, corpus: list[str | Path]) -> int:
    return sum(len(tokenizer(read_text(p), add_special_tokens=False)["input_ids"]) for p in expand(corpus))


def resolve(config: PipelineConfig, tokens: int) -> PipelineConfig:
    """`train.p` and `chunks.conversations` from the corpus where the budget says so."""
    budget, chunks, train = config.budget, config.chunks, config.train
    if budget.compression is not None:
        p = max((train.frozen or 1) + 1, math.ceil(tokens / budget.compression))
        train = train.replace(p=p)
    if budget.coverage is not None:
        span = (chunks.chunk_min + chunks.chunk_max) / 2
        spans = math.ceil(budget.coverage * tokens / min(span, max(tokens, 1)))
        chunks = chunks.replace(conversations=max(1, spans * chunks.per_chunk))
    return config.replace(chunks=chunks, train=train)


def rows_of(config: PipelineConfig) -> int:
    """Supervised rows: one per turn of each planned conversation."""
    return config.chunks.conversations * config.synth.turns


def steps_of(config: PipelineConfig, kept: float = 1.0) -> int:
    """Optimizer steps over the planned rows, of which the filter keeps the share `kept`."""
    return math.ceil(rows_of(config) * kept * config.train.epochs / config.train.accum)


def plan_line(config: PipelineConfig, tokens: int, rates: Rates | None, basis: str = "", pilot: int = 0) -> str:
    """The plan, its steps and minutes at `rates` (`basis` says where they come from), less the
    conversations taken over from a pilot whose plan held `pilot`."""
    rows, convs = config.train.p, config.chunks.conversations
    turns = f" of {config.synth.turns} turns" if config.synth.turns > 1 else ""
    steps = rates.steps(config) if rates else steps_of(config)
    minutes = (f"about {rates.seconds(config, pilot) / 60:.0f} min on this machine ({basis})"
               if rates else "no estimate yet (no earlier run of this model in this store)")
    return (f"plan: {tokens:,} corpus tokens -> {rows:,} rows ({tokens / rows:.1f}x fewer), "
            f"{convs:,} conversations{turns}, {steps:,} training steps; {minutes}")


@dataclasses.dataclass(frozen=True)
class Rates:
    """What a run costs on this machine, read off a finished run: seconds per conversation row
    (self-study, grounding and teacher targets), per optimizer step, and the rest (ingest, chunk
    plan, init, held-out scoring, export), which does not grow with the conversations; and the
    share of planned training rows that pass the filter, which sets how many steps there are."""

    per_row: float
    per_step: float
    fixed: float
    kept: float = 1.0

    @classmethod
    def of(cls, summary: dict) -> Rates:
        """The rates of the run that `summary` reports."""
        if not summary["steps"]:
            raise CartridgeError(f"budget.minutes: the pilot run trained no step (the filter kept none of its "
                                 f"{summary['conversation_rows']} conversations), so it measured no speed; "
                                 "give --conversations instead")
        seconds = {s["stage"]: s["seconds"] or 0.0 for s in summary["stages"]}
        rows = summary["conversation_rows"]
        per_row = sum(seconds[name] for name in ("synthesize", "facts", "teacher")) / rows
        fixed = summary["seconds"] - per_row * rows - summary["train_seconds"]
        kept = min(1.0, summary["train_conversations"] / max(1, summary["train_rows"]))
        return cls(per_row, summary["train_seconds"] / summary["steps"], max(0.0, fixed), kept)

    def steps(self, config: PipelineConfig) -> int:
        return steps_of(config, self.kept)

    def seconds(self, config: PipelineConfig, pilot: int = 0) -> float:
        """The run of `config` at these rates (held-out conversations are synthesized too), less the
        conversations it takes over from a pilot run of `pilot` planned conversations (`taken`)."""
        rows = (config.chunks.conversations + config.chunks.heldout - taken(config, pilot)) * config.synth.turns
        return self.fixed + rows * self.per_row + self.steps(config) * self.per_step


def taken(config: PipelineConfig, pilot: int) -> int:
    """Planned conversations (held-out ones included) of `config` that a pilot run with the same
    seeds, whose plan held `pilot`, already synthesized: the full shards both plans start with
    (a larger plan starts with the whole of a smaller one, `stages.chunks`)."""
    size = config.synth.gen_batch
    return size * min(pilot // size, (config.chunks.conversations + config.chunks.heldout) // size)


def earlier_rates(store: Store, model_id: str) -> tuple[Rates | None, int]:
    """The median `Rates` of this store's pilot runs and earlier runs of this model on this machine
    that synthesized, scored and trained afresh (reused stages, or a pilot's shards taken over,
    would time short; None with no such run), and how many runs they rest on."""
    found = []
    for run in store.catalog.runs():
        s = run["summary"] or {}
        if s.get("model_id") != model_id or s.get("machine") != machine_id():
            continue
        if run["flow"] == PILOT and run["status"] == "complete" and "rates" in s:
            found.append(Rates(**s["rates"]))
        elif (run["flow"] == "cartridge" and s.get("steps") and "train_rows" in s
              and not set(TIMED) & set(s.get("skipped") or []) and not (s.get("budget") or {}).get("taken")):
            found.append(Rates.of(s))
    if not found:
        return None, 0
    return Rates(*(statistics.median(getattr(r, f.name) for r in found) for f in dataclasses.fields(Rates))), len(found)


def pilot_config(config: PipelineConfig, workers: int = 1) -> PipelineConfig:
    """The short run that measures `Rates` for `config`: one synthesis shard per worker, held-out
    conversations included (shards run in lockstep batches, so a smaller or ragged pilot would
    time smaller batches), one epoch. Its plan starts the plan of the run it sizes, so that run
    takes over its synthesis (`taken`)."""
    planned = max(config.chunks.per_chunk, config.synth.gen_batch * workers - config.chunks.heldout)
    budget = config.budget.replace(minutes=None, coverage=None)
    return config.replace(chunks=config.chunks.replace(conversations=planned),
                          train=config.train.replace(epochs=1), budget=budget)


def pilot_key(pilot: PipelineConfig, model_id: str, corpus: list[str | Path]) -> str:
    """What a pilot's rates hold for: its config (as the stages fingerprint it, so a rerun that only
    adds checkpoints finds the same pilot; seeds left out, since they choose which spans and
    questions, not how long they are, so a rerun with another `--seed` sizes alike), the model
    and dtype, this machine, the corpus."""
    sections = {f.name: {k: v for k, v in getattr(pilot, f.name).fingerprint_dict().items() if k != "seed"}
                for f in dataclasses.fields(pilot)}
    texts = [read_text(p) for p in expand(corpus)]
    return sha256_bytes(canonical_json({
        "config": sections, "model": model_id, "machine": machine_id(),
        "corpus": [sha256_bytes(t.encode()) for t in texts]}).encode())[:16]


def fit_minutes(config: PipelineConfig, rates: Rates, spent: float = 0.0, pilot: int = 0) -> PipelineConfig:
    """`chunks.conversations` set to the most that `budget.minutes`, less `spent` seconds (the
    pilot's, on the first run it sizes), holds at `rates`, the conversations taken over from a
    pilot whose plan held `pilot` costing nothing; a budget too short for one chunk's
    conversations is an error that says how long the least run takes."""
    seconds = config.budget.minutes * 60 - spent
    turns = config.synth.turns
    per_conversation = turns * (rates.per_row + rates.per_step * rates.kept * config.train.epochs / config.train.accum)
    room = seconds - rates.fixed - config.chunks.heldout * turns * rates.per_row

    def sized(n: int) -> PipelineConfig:
        return config.replace(chunks=config.chunks.replace(conversations=n))

    ahead = pilot // config.synth.gen_batch * config.synth.gen_batch * turns * rates.per_row  # the most taken
    n, least = int((room + ahead) // per_conversation), config.chunks.per_chunk
    while n >= least and rates.seconds(sized(n), pilot) > seconds:  # the last step, rounded up, may not fit
        n -= 1
    if n < least:
        after = f" after the pilot's {spent / 60:.1f} min" if spent else ""
        raise CartridgeError(
            f"budget.minutes={config.budget.minutes:g}: too short for this corpus on this machine; "
            f"the least run ({least} conversations) takes about "
            f"{math.ceil(rates.seconds(sized(least), pilot) / 60)} min here{after}")
    return sized(n)


def rates_line(config: PipelineConfig, rates: Rates, source: str, spent: float = 0.0, pilot: int = 0) -> str:
    after = f", after the pilot's {spent / 60:.1f} min" if spent else ""
    shared = taken(config, pilot)
    ahead = f" ({shared:,} synthesized by the pilot, held-out ones included)" if shared else ""
    return (f"budget: {config.budget.minutes:g} min{after} -> {config.chunks.conversations:,} conversations{ahead} at "
            f"{rates.per_row:.2f} s per conversation, {rates.per_step:.2f} s per training step and "
            f"{rates.fixed / 60:.1f} min of fixed work ({source})")
