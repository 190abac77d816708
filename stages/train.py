"""Train stage: an initialized cartridge trained on the teacher targets with Adam.

Checkpoints (`save_every` steps) are step-numbered files plus a `progress.json`
written last, so a crash at any moment leaves a consistent checkpoint; a rerun of
the same artifact resumes from it and continues exactly where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

from cartridges.core.cartridge import init_cartridge
from cartridges.core.corpus import document_text
from cartridges.core.errors import CartridgeError
from cartridges.core.files import load_cartridge, load_optimizer, save_cartridge, save_optimizer
from cartridges.core.models import LoadedModel
from cartridges.core.train import (
    Example,
    TailAverage,
    group_backward,
    lr_at,
    make_optimizer,
    mean_loss,
)
from schemas import TABLES, TrainConfig, validate_table
from stages.job import Job
from stages.progress import progress as progress_bar
from storage import StageContext, StageResult, Store
from storage.atomic import write_json_atomic
from storage.faults import fault_point

NAME = "train"
VERSION = 1
CARTRIDGE_FILE = "cartridge.safetensors"
SUMMARY_FILE = "summary.json"


def load_examples(conversations: pa.Table, targets: pa.Table) -> tuple[list[Example], list[Example]]:
    """Train and held-out examples: conversations that have teacher targets."""
    by_conv: dict[int, list[tuple[int, list[int], list[float]]]] = defaultdict(list)
    t = targets.to_pydict() if targets.num_rows else {k: [] for k in ("conv_id", "position", "topk_ids", "topk_logprobs")}
    for conv, pos, ids, lps in zip(t["conv_id"], t["position"], t["topk_ids"], t["topk_logprobs"], strict=True):
        by_conv[conv].append((pos, ids, lps))
    train, heldout = [], []
    for c in conversations.to_pylist():
        rows = sorted(by_conv.get(c["conv_id"], []))
        if not rows:
            continue
        ex = Example(c["conv_id"], c["student_ids"], [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
        (heldout if c["split"] == "heldout" else train).append(ex)
    return train, heldout


def schedule(examples: list[Example], config: TrainConfig) -> list[list[Example]]:
    """Optimizer groups for all epochs; order keyed by (seed, epoch) so reruns match."""
    groups = []
    for epoch in range(config.epochs):
        order = list(examples)
        random.Random(f"{config.seed}:{epoch}").shuffle(order)
        groups += [order[i : i + config.accum] for i in range(0, len(order), config.accum)]
    return groups


WINDOW_QUESTIONS = 64  # init snapkv_questions: questions in its observation window


def window_questions(examples: list[Example], count: int = WINDOW_QUESTIONS) -> list[list[int]]:
    """The student's prompt (question and the answer's header) of `count` conversations spread
    evenly over the training set, in conversation order so that reruns match."""
    ordered = sorted(examples, key=lambda ex: ex.conv_id)
    step = max(1, len(ordered) // count)
    return [ex.ids[: ex.positions[0]] for ex in ordered[::step][:count]]


def corpus_of(docs: list[dict]) -> str:
    multi = len(docs) > 1
    return "\n".join(document_text(d["name"], d["text"], multi) for d in docs)


def train_cartridge(
    ctx_dir: Path, lm: LoadedModel, docs: list[dict], train: list[Example], heldout: list[Example],
    config: TrainConfig, run_id: str = "", progress: Callable[[dict], None] | None = None,
) -> dict:
    """The training loop proper; returns the summary (also written to `summary.json`)."""
    text = corpus_of(docs)
    corpus_sha = hashlib.sha256("".join(d["sha256"] for d in docs).encode()).hexdigest()
    names = [d["name"] for d in docs]
    groups = schedule(train, config)
    state_path = ctx_dir / "progress.json"
    average = TailAverage(config.average, len(groups))
    if state_path.is_file():  # resume from the last consistent checkpoint
        state = json.loads(state_path.read_text())
        cart = load_cartridge(ctx_dir / state["cartridge"], device=lm.device)
        opt = make_optimizer(cart, config.lr)
        load_optimizer(ctx_dir / state["optimizer"], opt)
        log, start, before = state["log"], state["step"], state["heldout_before"]
        if state.get("average"):
            average.mean = [p.detach() for p in load_cartridge(ctx_dir / state["average"], device=lm.device).parameters()]
    else:
        questions = window_questions(train) if config.init == "snapkv_questions" else ()
        cart = init_cartridge(lm, text, config.init, config.p, config.frozen, config.seed, questions)
        opt = make_optimizer(cart, config.lr)
        log, start, before = [], 0, mean_loss(lm.model, [cart], heldout)
    for step in range(start, len(groups)):
        t0 = time.perf_counter()
        lr = lr_at(step, len(groups), config.lr, config.schedule, config.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss = group_backward(lm.model, [cart], groups[step], packed=config.pack, checkpoint=config.checkpoint)
        opt.step()
        average.update(step, cart)
        row = {"run_id": run_id, "step": step, "docs": names, "visibility": "isolated", "loss": loss,
               "lr": lr, "tokens": sum(ex.n for ex in groups[step]),
               "seconds": time.perf_counter() - t0, "heldout_loss": None}
        log.append(row)
        if progress:
            progress({**row, "of": len(groups)})  # the bar's total
        if config.save_every and (step + 1) % config.save_every == 0 and step + 1 < len(groups):
            _checkpoint(ctx_dir, lm, cart, opt, step + 1, log, before, corpus_sha, average)
        fault_point(f"train.step.{step}")
    cart = average.result(cart)
    after = mean_loss(lm.model, [cart], heldout)
    init = cart.meta.get("init", config.init)  # what "auto" resolved to (a checkpoint's meta keeps it)
    if log:
        log[-1]["heldout_loss"] = after
    draft = lm.tokenizer(text, add_special_tokens=False)["input_ids"] if config.draft_ref else None
    save_cartridge(ctx_dir / CARTRIDGE_FILE, cart, lm.fingerprint, steps=len(groups), corpus_sha256=corpus_sha,
                   init=init, lr=config.lr, draft_reference=draft)
    supervised = sum(r["tokens"] for r in log)
    summary = {
        "heldout_loss_before": before, "heldout_loss_after": after,
        "heldout_conversations": len(heldout), "train_conversations": len(train),
        "steps": len(groups), "supervised_tokens": supervised,
        "train_seconds": sum(r["seconds"] for r in log), "p": config.p, "lr": config.lr, "init": init,
        "frozen": cart.frozen,
        "losses": [r["loss"] for r in log],
    }
    write_json_atomic(ctx_dir / SUMMARY_FILE, summary)
    return {"summary": summary, "log": log}


def _checkpoint(ctx_dir: Path, lm, cart, opt, step: int, log: list, before, corpus_sha: str,
                average: TailAverage) -> None:
    cart_name, opt_name = f"ckpt-{step:06d}.cartridge.safetensors", f"ckpt-{step:06d}.optimizer.safetensors"
    save_cartridge(ctx_dir / cart_name, cart, lm.fingerprint, steps=step, corpus_sha256=corpus_sha)
    save_optimizer(ctx_dir / opt_name, opt, step)
    mean_name = None
    if average.mean is not None:  # the tail's running mean so far
        mean_name = f"ckpt-{step:06d}.average.safetensors"
        save_cartridge(ctx_dir / mean_name, average.result(cart), lm.fingerprint, steps=step, corpus_sha256=corpus_sha)
    write_json_atomic(ctx_dir / "progress.json", {"step": step, "cartridge": cart_name, "optimizer": opt_name,
                                                  "average": mean_name, "log": log, "heldout_before": before})
    for old in ctx_dir.glob("ckpt-*.safetensors"):
        if not old.name.startswith(f"ckpt-{step:06d}."):
            old.unlink()


def run(job: Job, config: TrainConfig, documents, conversations, targets) -> StageResult:
    """The trained cartridge; a progress bar follows the steps and the loss."""
    with progress_bar(None, "train", "step") as bar:
        def on_step(row: dict) -> None:
            bar.total = row["of"]
            if bar.n < row["step"]:  # resumed from a checkpoint: the earlier steps count as done
                bar.resume(row["step"] - bar.n)
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.4f}", refresh=False)  # drawn with the next line
        return _run(job, config, documents, conversations, targets, on_step)


def _run(job: Job, config: TrainConfig, documents, conversations, targets,
         progress: Callable[[dict], None]) -> StageResult:
    store, lm, run_id = job.store, job.model, job.run_id

    def work(ctx: StageContext) -> None:
        docs = ctx.read(documents).to_pylist()
        train, heldout = load_examples(ctx.read(conversations), ctx.read(targets))
        if not train:
            raise CartridgeError("no usable training conversations: every one was filtered as degenerate")
        result = train_cartridge(ctx.dir, lm, docs, train, heldout, config, run_id or "", progress)
        steps = pa.Table.from_pylist(result["log"], schema=TABLES["train_steps"])
        ctx.write_shard(0, validate_table("train_steps", steps))

    cfg = {**config.fingerprint_dict(), "model": job.model_id or ""}
    return store.run(NAME, VERSION, cfg, [documents, conversations, targets], work, force=job.forced(NAME),
                     run_id=run_id)


def summary_of(store: Store, artifact) -> dict:
    return json.loads((store.dir(artifact) / SUMMARY_FILE).read_text())
