"""Fleet data stages: each round's conversations and targets, and each document's held-out set.

Both are ordinary store artifacts keyed by their plan (document hash, chunk spans and
seeds, synthesis and teacher configs, model), so a resumed or repeated run reuses
them instead of generating again, and `cartridges sql` sees the latest ones as the
`conversations` and `targets` tables.
"""

from __future__ import annotations

import pyarrow as pa

from cartridges.core.models import LoadedModel
from cartridges.core.train import Example
from cartridges.fleet.plan import Chunk, RoundPlan, heldout_chunks
from schemas import TABLES, FleetConfig, SynthConfig, TeacherConfig, validate_table
from stages.synthesize import chunk_context, document_contexts, synthesize_group
from stages.teacher import target_rows, usable
from stages.train import load_examples
from storage import StageContext, StageResult, Store
from storage.faults import fault_point

ROUND = "fleet_round"
HELDOUT = "fleet_heldout"
VERSION = 1


def chunk_rows(chunks: list[Chunk], token_ids: list[int], split: str) -> list[dict]:
    """Rows shaped like the `chunks` table, for the synthesis stage's helpers."""
    return [
        {"chunk_id": i, "doc_id": c.doc_id, "start": c.start, "end": c.end, "tokens": c.end - c.start,
         "seed_type": c.seed_type, "split": split, "rng_seed": c.rng_seed, "token_ids": token_ids[c.start:c.end]}
        for i, c in enumerate(chunks)
    ]


def _conversations(ctx: StageContext, lm: LoadedModel, rows: list[dict], doc: dict, synth: SynthConfig,
                   teacher: TeacherConfig) -> None:
    contexts = [chunk_context(r, {}, False, lm.tokenizer) for r in rows]
    answers = None
    if synth.teacher_context == "document":
        text = lm.tokenizer.decode(doc["token_ids"])
        whole = document_contexts([{"doc_id": 0, "name": doc["name"], "tokens": len(doc["token_ids"]),
                                    "text": text}], synth, lm.context_length)
        answers = [whole[0]] * len(rows)
    convs = synthesize_group(lm, rows, contexts, synth, answer_contexts=answers) if rows else []
    table = pa.Table.from_pylist(convs, schema=TABLES["conversations"])
    ctx.write_shard(0, validate_table("conversations", table), table="conversations")
    fault_point("fleet.data.conversations")  # conversations written, targets not yet
    good = [c for c in convs if usable(c, synth.filter)]
    targets = pa.Table.from_pylist(target_rows(lm, good, teacher), schema=TABLES["targets"])
    ctx.write_shard(0, validate_table("targets", targets), table="targets")


def _spec(chunks: list[Chunk]) -> list[list]:
    return [[c.start, c.end, c.seed_type, c.rng_seed] for c in chunks]


def round_data(store: Store, lm: LoadedModel, plan: RoundPlan, doc: dict, config: FleetConfig,
               model_id: str, run_id: str | None = None) -> StageResult:
    """Conversations and teacher targets for one round's chunks of its target document.

    `doc`: name, sha256 and token_ids of the target document.
    """
    def work(ctx: StageContext) -> None:
        _conversations(ctx, lm, chunk_rows(list(plan.chunks), doc["token_ids"], "train"), doc, config.synth,
                       config.teacher)
        fault_point(f"fleet.round_data.{plan.round}")

    cfg = {"round": plan.round, "document": doc["name"], "sha256": doc["sha256"], "chunks": _spec(list(plan.chunks)),
           "synth": config.synth.fingerprint_dict(), "teacher": config.teacher.fingerprint_dict(), "model": model_id}
    return store.run(ROUND, VERSION, cfg, [], work, run_id=run_id)


def heldout_data(store: Store, lm: LoadedModel, doc: dict, config: FleetConfig, model_id: str,
                 run_id: str | None = None) -> StageResult:
    """Held-out conversations from the document's reserved tail (never quizzed in training)."""
    chunks = heldout_chunks(doc["doc_id"], len(doc["token_ids"]), config, salt=doc["sha256"])

    def work(ctx: StageContext) -> None:
        _conversations(ctx, lm, chunk_rows(chunks, doc["token_ids"], "heldout"), doc, config.synth, config.teacher)

    cfg = {"document": doc["name"], "sha256": doc["sha256"], "chunks": _spec(chunks),
           "synth": config.synth.fingerprint_dict(), "teacher": config.teacher.fingerprint_dict(), "model": model_id}
    return store.run(HELDOUT, VERSION, cfg, [], work, run_id=run_id)


def examples(store: Store, artifact: StageResult) -> list[Example]:
    """The artifact's conversations that have targets, as training examples (either split)."""
    train, heldout = load_examples(store.table(artifact, "conversations"), store.table(artifact, "targets"))
    return train + heldout
