"""Facts: the `sentences` table, each document sentence with the training conversations grounded in it.

The rule is `cartridges.selfstudy.facts` (word overlap between a sentence and a conversation's
question and answer). Only conversations used in training count: the `train` split,
with an answer, and past the degenerate-message filter when it was on (as the
teacher stage selects them). `cartridges sql "select text from sentences where
conversations = 0"` lists what no training conversation asks or tells about.
"""

from __future__ import annotations

import pyarrow as pa

from cartridges.selfstudy import facts
from schemas import SENTENCES
from stages.job import Job
from stages.teacher import usable
from storage import Artifact, StageContext, StageResult

NAME = "facts"
VERSION = 1


def sentence_rows(documents: list[dict], conversations: list[dict], filtered: bool = True) -> list[dict]:
    """Rows of the `sentences` table from documents (doc_id, text) and synthesized conversations."""
    by_doc: dict[int, list[str]] = {}
    for c in conversations:
        if c["split"] == "train" and usable(c, filtered):
            by_doc.setdefault(c["doc_id"], []).append(f"{c['question']}\n{c['answer']}")
    return [
        {"doc_id": d["doc_id"], "sentence": i, "text": text, "words": words, "conversations": n}
        for d in documents
        for i, (text, words, n) in enumerate(facts.grounding_counts(d["text"], by_doc.get(d["doc_id"], [])))
    ]


def fact_coverage(rows: list[dict]) -> float:
    """Share of sentences that at least one training conversation is grounded in."""
    return sum(r["conversations"] > 0 for r in rows) / max(1, len(rows))


def run(job: Job, config: None, documents: Artifact | StageResult,
        conversations: Artifact | StageResult) -> StageResult:
    """Write the `sentences` table for a synthesis artifact; skipped when neither input changed.
    The rule's constants are its config (`config` is None: no section of its own)."""
    store = job.store
    rule = {"min_shared": facts.MIN_SHARED, "share": facts.SHARE}

    def work(ctx: StageContext) -> None:
        if ctx.done_shards():
            return
        docs = ctx.read(documents).select(["doc_id", "text"]).to_pylist()
        columns = ["doc_id", "split", "question", "answer", "a_ok", "b_ok", "teacher_ids", "answer_start"]
        convs = ctx.read(conversations).select(columns).to_pylist()
        filtered = bool(conversations.config.get("filter", True))
        ctx.write_shard(0, pa.Table.from_pylist(sentence_rows(docs, convs, filtered), schema=SENTENCES))

    return store.run(NAME, VERSION, rule, [documents, conversations], work, force=job.forced(NAME),
                     run_id=job.run_id)
