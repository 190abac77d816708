"""The chunk plan the synthesis benchmarks share: one document's planned conversations."""

from __future__ import annotations

from schemas import ChunkConfig
from stages.chunks import plan_chunks
from stages.synthesize import chunk_context


def document_plan(tokenizer, ids: list[int], config: ChunkConfig) -> tuple[list[dict], list[str]]:
    """The planned chunks of one document (token ids) and the context each bot sees for each."""
    plan = plan_chunks([{"doc_id": 0, "token_ids": ids}], config)
    return plan, [chunk_context(c, {0: "doc"}, False, tokenizer) for c in plan]
