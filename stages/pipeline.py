"""The main job as plain function calls: corpus -> documents -> chunks -> conversations
(-> sentences they are grounded in) -> targets -> trained cartridge -> exported file.

`call` wraps each stage call; the Prefect flow passes a wrapper that runs the stage
as a task, tests pass none. Every stage is skipped when its fingerprint is already
complete in the catalog.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cartridges.core.health import health_fields
from cartridges.core.models import LoadedModel
from schemas import HealthConfig, PipelineConfig
from stages import chunks, facts, ingest, synthesize, teacher, train
from stages.fanout import Fanout
from stages.progress import progress
from stages.report import markdown_summary
from stages.run_report import write_run_report
from stages.teacher import usable
from storage import Store
from storage.atomic import atomic_path

Call = Callable[..., Any]


def _plain(fn: Callable, *args, **kwargs):
    return fn(*args, **kwargs)


def run_pipeline(
    store: Store, lm: LoadedModel, corpus: list[str | Path], config: PipelineConfig = PipelineConfig(),
    save: str | Path | None = None, force: tuple[str, ...] = (), call: Call = _plain,
    log: Callable[[str], None] = print, fanout: Fanout | None = None,
) -> dict:
    """Run every stage (skipping unchanged ones) and return the run summary.

    With `fanout`, synthesis and teacher shards run on its workers (same rows as in-process).
    """
    model_id = lm.compute_id
    run_id = store.catalog.start_run("cartridge")
    started = time.perf_counter()
    with store.catalog.failing_run(run_id):
        docs = call(ingest.run, store, corpus, lm.tokenizer, config.ingest, tokenizer_id=model_id,
                    force="ingest" in force, run_id=run_id)
        plan = call(chunks.run, store, docs, lm.tokenizer, config.chunks, force="chunks" in force, run_id=run_id,
                    tokenizer_id=model_id)
        planned = plan.rows
        with progress(planned, "self-study", "conv") as bar:
            convs = call(synthesize.run, store, lm, docs, plan, config.synth, model_id=model_id,
                         force="synthesize" in force, run_id=run_id, progress=bar.update, fanout=fanout)
        grounding = call(facts.run, store, docs, convs, force="facts" in force, run_id=run_id)
        filtered = bool(convs.config.get("filter", True))
        columns = ["teacher_ids", "answer_start", "a_ok", "b_ok"]
        answered = sum(usable(c, filtered) for c in store.table(convs).select(columns).to_pylist())
        with progress(answered, "teacher", "conv") as bar:
            targets = call(teacher.run, store, lm, convs, config.teacher, model_id=model_id,
                           force="teacher" in force, run_id=run_id, progress=bar.update, fanout=fanout)
        with progress(None, "train", "step") as bar:
            def on_step(row: dict) -> None:
                bar.total = row["of"]
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.4f}", refresh=False)  # drawn with the next line
            trained = call(train.run, store, lm, docs, convs, targets, config.train, model_id=model_id,
                           force="train" in force, run_id=run_id, progress=on_step)
        summary = summarize(store, docs, plan, convs, trained, planned, config.health)
        summary["fact_coverage"] = facts.fact_coverage(store.table(grounding).select(["conversations"]).to_pylist())
        arts = (docs, plan, convs, grounding, targets, trained)
        summary.update(run_id=run_id, seconds=time.perf_counter() - started, **lm.dtype_record(),
                       skipped=[a.stage for a in arts if a.skipped])
        cartridge = store.dir(trained) / train.CARTRIDGE_FILE
        if save:
            cartridge = export(cartridge, Path(save))
        summary["cartridge"] = str(cartridge)
        summary["stages"] = [{"stage": a.stage, "artifact": a.id, "skipped": a.skipped, "rows": a.rows,
                              "seconds": None if a.skipped else a.seconds}
                             for a in arts]
        write_run_report(store, summary, markdown_summary, f"cartridge run {run_id}")
        store.catalog.finish_run(run_id, "complete" if summary["health"] == "ok" else "failed", summary)
        return summary


def export(source: Path, target: Path) -> Path:
    """Copy the trained cartridge to a user path atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as tmp:
        shutil.copyfile(source, tmp)
    return target


def summarize(store: Store, docs, plan, convs, trained, planned: int, health: HealthConfig) -> dict:
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
        "planned_conversations": planned,
        "a_ok_rate": sum(c["a_ok"] for c in conv_rows) / max(1, len(conv_rows)),
        "b_degenerate_rate": sum((c["a_ok"] and not c["b_ok"]) for c in conv_rows) / max(1, sum(c["a_ok"] for c in conv_rows)),
        "seed_types": by_seed,
        "corpus_tokens": corpus_tokens,
        "coverage_min": coverage_min,
        "coverage_mean": coverage_mean,
        "synth_seconds": synth_seconds,
        "s_per_conversation": synth_seconds / max(1, len(conv_rows)),
    }
