"""The cartridge job: the stage graph (`stages.graph.CARTRIDGE`) run once over a corpus.

corpus -> documents -> chunks -> conversations (-> sentences they are grounded in) ->
targets -> trained cartridge -> exported file. Every stage is skipped when its
fingerprint is already complete in the catalog. `cartridge_run` holds the run's record
around the stage calls, so the Prefect flow can make each call a task and still show the
chain; `run_pipeline` is the same run with plain calls.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from cartridges.core.health import health_fields
from cartridges.core.models import LoadedModel
from cartridges.core.speed import machine_id
from jobs import Call, plain
from jobs.plan import (
    PILOT,
    TIMED,
    Rates,
    corpus_tokens,
    earlier_rates,
    fit_minutes,
    pilot_config,
    pilot_key,
    plan_line,
    rates_line,
    resolve,
    taken,
)
from jobs.report import write_run_report
from schemas import HealthConfig, PipelineConfig
from stages import chunks, facts, train
from stages.fanout import Fanout
from stages.graph import CARTRIDGE, Stage
from stages.job import Job
from stages.teacher import usable
from storage import StageResult, Store
from storage.atomic import atomic_path

NAME = "cartridge"


class CartridgeRun:
    """One run of the cartridge job: the job every stage gets, and the artifacts made so far."""

    def __init__(self, job: Job, config: PipelineConfig, budget: dict | None = None) -> None:
        self.job, self.config, self.budget = job, config, budget
        self.artifacts: dict[str, StageResult] = {}
        self.summary: dict = {}

    def stage(self, stage: Stage, call: Call = plain) -> StageResult:
        """Run `stage` on its inputs' artifacts (through `call`) and keep its artifact."""
        inputs = [self.artifacts[name] for name in stage.inputs]
        self.artifacts[stage.name] = call(stage.run, self.job, stage.section(self.config), *inputs)
        return self.artifacts[stage.name]


@contextmanager
def cartridge_run(
    store: Store, lm: LoadedModel, corpus: list[str | Path], config: PipelineConfig = PipelineConfig(),
    save: str | Path | None = None, force: tuple[str, ...] = (), fanout: Fanout | None = None,
    run_id: str | None = None,
) -> Iterator[CartridgeRun]:
    """The catalog run around the stage calls made in the `with` body; on leaving it, the run's
    summary (in `.summary`) and report are written and the run is closed (failed on an error).
    With `run_id`, the stages record under that run, which its caller opened and closes (a pilot's)."""
    tokens = corpus_tokens(lm.tokenizer, corpus)
    config, budget = resolve(config, tokens), None
    if config.budget.minutes is None:
        rates, runs = earlier_rates(store, lm.compute_id)
        print(plan_line(config, tokens, rates, f"from {runs} earlier run{'s' * (runs != 1)}"), flush=True)
    else:
        rates, source, pilot = pilot_rates(store, lm, corpus, config, fanout)
        spent = 0.0 if pilot_paid(store, pilot["run_id"]) else pilot["seconds"]
        config = fit_minutes(config, rates, spent, pilot["conversations"])
        estimate = rates.seconds(config, pilot["conversations"])
        budget = {"minutes": config.budget.minutes, "conversations": config.chunks.conversations,
                  "estimate_seconds": estimate, "rates": dataclasses.asdict(rates),
                  "pilot": pilot["run_id"], "pilot_seconds": spent,
                  "taken": taken(config, pilot["conversations"])}
        print(rates_line(config, rates, source, spent, pilot["conversations"]), flush=True)
        print(plan_line(config, tokens, rates, "at the pilot's speeds", pilot["conversations"]), flush=True)
    held = run_id is not None
    run_id = run_id or store.catalog.start_run(NAME)
    started = time.perf_counter()
    with nullcontext() if held else store.catalog.failing_run(run_id):
        run = CartridgeRun(Job(store, lm, tuple(corpus), run_id, frozenset(force), fanout), config, budget)
        yield run
        run.summary = finish(run, save, time.perf_counter() - started)
        if not held:
            status = "complete" if run.summary["health"] == "ok" else "failed"
            store.catalog.finish_run(run_id, status, run.summary)


def run_pipeline(
    store: Store, lm: LoadedModel, corpus: list[str | Path], config: PipelineConfig = PipelineConfig(),
    save: str | Path | None = None, force: tuple[str, ...] = (), fanout: Fanout | None = None,
    run_id: str | None = None,
) -> dict:
    """Run every stage (skipping unchanged ones) and return the run summary.

    With `fanout`, synthesis and teacher shards run on its workers (same rows as in-process).
    """
    with cartridge_run(store, lm, corpus, config, save, force, fanout, run_id) as run:
        for stage in CARTRIDGE:
            run.stage(stage)
    return run.summary


def pilot_rates(
    store: Store, lm: LoadedModel, corpus: list[str | Path], config: PipelineConfig, fanout: Fanout | None,
) -> tuple[Rates, str, dict]:
    """This machine's `Rates` for `config`, where they come from, and the pilot run (its id, its
    seconds, and the planned conversations the run may take over from it: none where the seeds
    differ or its synthesis is gone): this store's pilot run for the same config, model, machine and corpus, or a new one.
    The pilot runs in this store with the stages it times computed afresh (so reused work never
    shortens them), and the run it sizes takes over its synthesis shards; the catalog keeps its
    rates, so a rerun (after a crash, say) sizes the run alike and resumes it. Speeds are per
    corpus: on three 3,000-token documents a pilot of one sized the others' 30 minutes 16-19%
    wrong (docs/PIPELINE.md)."""
    pilot = pilot_config(config, fanout.workers if fanout else 1)
    key = pilot_key(pilot, lm.compute_id, corpus)
    for run in reversed(store.catalog.runs()):
        s = run["summary"] or {}
        if run["flow"] == PILOT and run["status"] == "complete" and s.get("key") == key:
            shared = s.get("seeds") == _seeds(config) and _synthesis_kept(store, run["run_id"])
            found = {"run_id": run["run_id"], "seconds": s["seconds"], "conversations": s["conversations"] if shared else 0}
            return Rates(**s["rates"]), f"speeds from pilot run {run['run_id']}", found
    print(f"budget: a pilot run of {pilot.chunks.conversations} conversations measures this machine's speeds",
          flush=True)
    run_id = store.catalog.start_run(PILOT)
    with store.catalog.failing_run(run_id):
        summary = run_pipeline(store, lm, corpus, pilot, force=TIMED, fanout=fanout, run_id=run_id)
        rates = Rates.of(summary)
        store.catalog.finish_run(run_id, "complete", {
            "key": key, "rates": dataclasses.asdict(rates), "seconds": summary["seconds"],
            "conversations": summary["planned_conversations"], "seeds": _seeds(pilot),
            "model_id": lm.compute_id, "machine": machine_id()})
    found = {"run_id": run_id, "seconds": summary["seconds"], "conversations": summary["planned_conversations"]}
    return rates, f"speeds measured by pilot run {run_id}", found


def _synthesis_kept(store: Store, pilot_id: str) -> bool:
    """Whether the pilot's conversations are still in the store (`cartridges store prune` may remove them)."""
    return any(a.run_id == pilot_id and a.status == "complete" and store.dir(a).is_dir()
               for a in store.catalog.artifacts("synthesize"))


def _seeds(config: PipelineConfig) -> list[int]:
    """The seeds that choose a run's spans and questions: a pilot's shards serve runs with its seeds."""
    return [config.chunks.seed, config.synth.seed]


def pilot_paid(store: Store, pilot_id: str) -> bool:
    """Whether a complete run already counted this pilot in its minutes. The first run a pilot
    sizes pays for it, so that run, pilot included, fits its budget; a rerun after a crash pays
    again, so it sizes alike and resumes."""
    return any(run["flow"] == NAME and run["status"] == "complete"
               and ((run["summary"] or {}).get("budget") or {}).get("pilot") == pilot_id
               for run in store.catalog.runs())


def finish(run: CartridgeRun, save: str | Path | None, seconds: float) -> dict:
    """The run's summary and report, with the cartridge exported to `save` when given."""
    store, a = run.job.store, run.artifacts
    summary = summarize(store, a["ingest"], a["chunks"], a["synthesize"], a["train"], run.config.health)
    summary["fact_coverage"] = facts.fact_coverage(store.table(a["facts"]).select(["conversations"]).to_pylist())
    arts = [a[stage.name] for stage in CARTRIDGE]
    summary.update(kind=NAME, run_id=run.job.run_id, seconds=seconds, **run.job.model.dtype_record(),
                   model_id=run.job.model_id, machine=machine_id(),
                   skipped=[x.stage for x in arts if x.skipped])
    if run.budget:
        summary["budget"] = run.budget
    cartridge = store.dir(a["train"]) / train.CARTRIDGE_FILE
    if save:
        cartridge = export(cartridge, Path(save))
    summary["cartridge"] = str(cartridge)
    summary["stages"] = [{"stage": x.stage, "artifact": x.id, "skipped": x.skipped, "rows": x.rows,
                          "seconds": None if x.skipped else x.seconds}
                         for x in arts]
    write_run_report(store, summary)
    return summary


def export(source: Path, target: Path) -> Path:
    """Copy the trained cartridge to a user path atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as tmp:
        shutil.copyfile(source, tmp)
    return target


def summarize(store: Store, docs, plan, convs, trained, health: HealthConfig) -> dict:
    """Losses, data quality, coverage and timings of one run.

    Coverage counts, for every token of every document, the training spans that hold
    it, where a span counts when at least one of its conversations is used in training.
    """
    result = train.summary_of(store, trained)
    documents = store.table(docs).select(["doc_id", "tokens"]).to_pylist()
    chunk_rows = store.table(plan).select(["chunk_id", "doc_id", "start", "end", "split"]).to_pylist()
    conv_rows = store.table(convs).select(["chunk_id", "seed_type", "split", "a_ok", "b_ok", "a_reason", "b_reason",
                                           "teacher_ids", "answer_start"]).to_pylist()
    corpus_tokens = sum(d["tokens"] for d in documents)
    used = result["train_conversations"]
    filtered = bool(convs.config.get("filter", True))
    trained_chunks = {c["chunk_id"] for c in conv_rows if c["split"] == "train" and usable(c, filtered)}
    coverage_min, coverage_mean = chunks.train_coverage(
        [(d["doc_id"], d["tokens"]) for d in documents],
        [c for c in chunk_rows if c["chunk_id"] in trained_chunks], int(plan.config.get("per_chunk", 1)))
    by_seed: dict[str, int] = {}
    for c in conv_rows:
        by_seed[c["seed_type"]] = by_seed.get(c["seed_type"], 0) + 1
    synth_seconds = convs.artifact.seconds or 0.0
    return {
        **result,
        **health_fields(result["losses"], result["heldout_loss_before"], result["heldout_loss_after"], health),
        "conversations": used,
        "planned_conversations": plan.rows,
        "train_rows": sum(c["split"] == "train" for c in conv_rows),
        "conversation_rows": len(conv_rows),
        "a_ok_rate": sum(c["a_ok"] for c in conv_rows) / max(1, len(conv_rows)),
        "b_degenerate_rate": sum((c["a_ok"] and not c["b_ok"]) for c in conv_rows) / max(1, sum(c["a_ok"] for c in conv_rows)),
        "seed_types": by_seed,
        "corpus_tokens": corpus_tokens,
        "coverage_min": coverage_min,
        "coverage_mean": coverage_mean,
        "synth_seconds": synth_seconds,
        "s_per_conversation": synth_seconds / max(1, len(conv_rows)),
    }
