"""The plan of a cartridge run, before the long work starts: rows, conversations, minutes.

Budgets can follow the corpus (`budget.compression`: corpus tokens per row; `budget.coverage`:
training spans over each token, on average). The estimate comes from this store's earlier runs
of the same model on this machine (seconds per conversation of self-study and per training
step, medians); with none, the plan says so rather than guess.
"""

from __future__ import annotations

import math
import platform
import statistics
from pathlib import Path

from cartridges.core.corpus import expand, read_text
from schemas import PipelineConfig
from storage import Store


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


def steps_of(config: PipelineConfig) -> int:
    return math.ceil(rows_of(config) * config.train.epochs / config.train.accum)


def estimate_seconds(store: Store, model_id: str, config: PipelineConfig) -> tuple[float | None, int]:
    """Seconds of self-study and training for `config`, from the earlier complete runs of this model
    on this machine in `store` (None with no such run), and how many runs it rests on."""
    per_conv, per_step = [], []
    for run in store.catalog.runs():
        s = run["summary"] or {}
        if run["flow"] != "cartridge" or s.get("model_id") != model_id or s.get("machine") != platform.node():
            continue
        if s.get("s_per_conversation") and "synthesize" not in (s.get("skipped") or []):
            per_conv.append(s["s_per_conversation"])
        if s.get("steps") and s.get("train_seconds") and "train" not in (s.get("skipped") or []):
            per_step.append(s["train_seconds"] / s["steps"])
    if not per_conv or not per_step:
        return None, 0
    total = rows_of(config) * statistics.median(per_conv) + steps_of(config) * statistics.median(per_step)
    return total, min(len(per_conv), len(per_step))


def plan_line(config: PipelineConfig, tokens: int, estimate: tuple[float | None, int]) -> str:
    rows, convs = config.train.p, config.chunks.conversations
    seconds, runs = estimate
    turns = f" of {config.synth.turns} turns" if config.synth.turns > 1 else ""
    minutes = (f"about {seconds / 60:.0f} min on this machine (from {runs} earlier run{'s' * (runs != 1)})"
               if seconds is not None else "no estimate yet (no earlier run of this model in this store)")
    return (f"plan: {tokens:,} corpus tokens -> {rows:,} rows ({tokens / rows:.1f}x fewer), "
            f"{convs:,} conversations{turns}, {steps_of(config):,} training steps; {minutes}")
