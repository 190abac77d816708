"""Teacher pass: B's tokens teacher-forced through the frozen model with B's exact context.

Bot B already computed that distribution at every answer token while it generated
(greedy decoding reads the same model over the same ids); where it kept the top
entries (`synth.keep_topk`), they are cut to this stage's top-k and mass and no
forward runs. Conversations without them (re-tokenized answers, older artifacts,
a deeper top-k than was kept) are computed here.

Targets are keyed by position in the STUDENT sequence (the teacher sequence minus
the chunk's system turn), which is where the training stage reads them.
"""

from __future__ import annotations

import pyarrow as pa
import torch

from cartridges.core.models import LoadedModel
from cartridges.core.sharing import SHARE_MIN
from cartridges.core.targets import cut_at_mass, teacher_targets
from schemas import TABLES, TeacherConfig, validate_table
from stages.fanout import report_resumed_shards
from stages.job import Job
from stages.progress import Bar
from stages.progress import progress as progress_bar
from storage import StageContext, StageResult
from storage.faults import fault_point

NAME = "teacher"
VERSION = 3

# Conversations per Parquet shard: the unit of work a crash can lose.
SHARD = 32


def usable(conv: dict, filtered: bool = True) -> bool:
    """Has an answer to supervise, and passed the degenerate-message filter when it was on."""
    answered = len(conv["teacher_ids"]) > conv["answer_start"] > 0
    return answered and (not filtered or bool(conv["a_ok"] and conv["b_ok"]))


def kept(conv: dict, top_k: int, vocab: int) -> bool:
    """Whether bot B kept this conversation's targets, at least `top_k` deep."""
    ids = conv.get("answer_topk_ids")
    if not ids or len(ids) != len(conv["teacher_ids"]) - conv["answer_start"]:
        return False
    return len(ids[0]) >= min(top_k, vocab)


def _vocab(lm: LoadedModel) -> int:
    return int(lm.model.get_output_embeddings().weight.shape[0])


def kept_targets(conv: dict, config: TeacherConfig) -> list[tuple[list[int], list[float]]]:
    """Bot B's kept entries cut to the teacher's top-k and mass, as the forward would cut them."""
    ids = torch.tensor(conv["answer_topk_ids"], dtype=torch.long)[:, : config.top_k]
    values = torch.tensor(conv["answer_topk_logprobs"], dtype=torch.float32)[:, : config.top_k]
    return cut_at_mass(values, ids, config.top_mass)


def target_rows(lm: LoadedModel, convs: list[dict], config: TeacherConfig) -> list[dict]:
    """Targets rows for `convs`: bot B's kept entries where it kept them, a forward for the rest."""
    vocab = _vocab(lm)
    rows = []
    for start in range(0, len(convs), config.batch):
        group = convs[start : start + config.batch]
        targets: list = [kept_targets(c, config) if kept(c, config.top_k, vocab) else None for c in group]
        todo = [i for i, t in enumerate(targets) if t is None]
        if todo:
            computed = teacher_targets(
                lm.model, [group[i]["teacher_ids"] for i in todo], [group[i]["answer_start"] for i in todo],
                config.top_k, config.top_mass, share_min=SHARE_MIN,
            )
            for i, per_position in zip(todo, computed, strict=True):
                targets[i] = per_position
        for conv, per_position in zip(group, targets, strict=True):
            for j, (ids, logprobs) in enumerate(per_position):
                rows.append({
                    "conv_id": conv["conv_id"], "position": conv["student_answer_start"] + j,
                    "topk_ids": ids, "topk_logprobs": logprobs,
                })
        fault_point("teacher.batch")
    return rows


def teacher_shard(job: dict) -> int:
    """One shard of targets, computed and written by a worker (no catalog); returns its rows."""
    from stages.fanout import worker_model
    from storage.shards import write_shard

    rows = target_rows(worker_model(job["model"]), job["conversations"], TeacherConfig.from_dict(job["config"]))
    write_shard(job["dir"], job["shard"], validate_table("targets", pa.Table.from_pylist(rows, schema=TABLES["targets"])))
    fault_point(f"teacher.shard.{job['shard']}")
    return len(rows)


def run(job: Job, config: TeacherConfig, conversations) -> StageResult:
    """Targets for every usable conversation, `SHARD` per shard; the job's fanout sends shards to workers."""
    filtered = bool(conversations.config.get("filter", True))
    columns = ["teacher_ids", "answer_start", "a_ok", "b_ok"]
    answered = sum(usable(c, filtered) for c in job.store.table(conversations).select(columns).to_pylist())
    with progress_bar(answered, "teacher", "conv") as bar:
        return _run(job, config, conversations, bar)


def _run(job: Job, config: TeacherConfig, conversations, bar: Bar) -> StageResult:
    store, lm, fanout = job.store, job.model, job.fanout

    def work(ctx: StageContext) -> None:
        filtered = bool(conversations.config.get("filter", True))
        convs = [c for c in ctx.read(conversations).to_pylist() if usable(c, filtered)]
        done = ctx.done_shards()
        jobs = []
        vocab = _vocab(lm)
        report_resumed_shards(bar, convs, SHARD, done)
        for shard, start in enumerate(range(0, len(convs), SHARD)):
            group = convs[start : start + SHARD]
            needs_forward = not all(kept(c, config.top_k, vocab) for c in group)
            if shard not in done and fanout is not None and needs_forward:
                needed = ["conv_id", "teacher_ids", "answer_start", "student_answer_start",
                          "answer_topk_ids", "answer_topk_logprobs"]
                jobs.append({"model": fanout.model, "config": config.to_dict(), "dir": str(ctx.dir),
                             "shard": shard, "conversations": [{k: c[k] for k in needed} for c in group]})
            elif shard not in done:
                rows = target_rows(lm, group, config)
                ctx.write_shard(shard, validate_table("targets", pa.Table.from_pylist(rows, schema=TABLES["targets"])))
                fault_point(f"teacher.shard.{shard}")
                bar.update(len(group))
        if jobs:
            fanout.map(teacher_shard, jobs, lambda job: bar.update(len(job["conversations"])))

    cfg = {**config.fingerprint_dict(), "model": job.model_id or ""}
    return store.run(NAME, VERSION, cfg, [conversations], work, force=job.forced(NAME), run_id=job.run_id)
