"""What the synthesis benchmarks share: one document's planned conversations, and a hash of
the answers an arm wrote, so two arms can show they made the same rows."""

from __future__ import annotations

import hashlib
import json

from schemas import ChunkConfig
from stages.chunks import plan_chunks
from stages.synthesize import chunk_context


def document_plan(tokenizer, ids: list[int], config: ChunkConfig) -> tuple[list[dict], list[str]]:
    """The planned chunks of one document (token ids) and the context each bot sees for each."""
    plan = plan_chunks([{"doc_id": 0, "token_ids": ids}], config)
    return plan, [chunk_context(c, {0: "doc"}, False, tokenizer) for c in plan]


def answers_hash(rows: list[dict]) -> str:
    """One digest of the synthesized rows' answers, in order."""
    return hashlib.sha256(json.dumps([r["answer"] for r in rows]).encode()).hexdigest()
