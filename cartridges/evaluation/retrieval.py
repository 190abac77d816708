"""Retrieval as an eval arm: the corpus chunks most like the question, in the context, at a row budget.

The peer a user would pick over a cartridge on a corpus longer than the window. Chunks are
fixed token spans of each document; a question ranks them lexically (BM25 over the chunk
words) or densely (the fleet index's embedding: the model's own final hidden state behind a
topic suffix, centered); the best ones fill the budget (each chunk that still fits, in rank
order) and go into the context in document order, as one system turn. The context's KV rows
(template included) stay at or below the budget, and a chunk more would not have fitted.
"""

from __future__ import annotations

from dataclasses import dataclass

import faiss
import numpy as np

from cartridges.core.chat import system_ids
from cartridges.core.similarity import BM25, apply_centroid, center, embed_text

RETRIEVERS = ("bm25", "dense")
SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Chunk:
    doc: int  # the document's position in the corpus
    start: int  # token offsets within the document
    end: int
    text: str


def corpus_chunks(tokenizer, docs: list[str], size: int) -> list[Chunk]:
    """Every document cut into `size`-token spans, in corpus order."""
    if size < 1:
        raise ValueError(f"chunk size must be positive (got {size})")
    out = []
    for d, text in enumerate(docs):
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        for start in range(0, len(ids), size):
            end = min(start + size, len(ids))
            out.append(Chunk(d, start, end, tokenizer.decode(ids[start:end])))
    return out


class Retriever:
    """Ranks a corpus's chunks against a question; built once per corpus."""

    def __init__(self, chunks: list[Chunk], kind: str, model=None, tokenizer=None) -> None:
        if kind not in RETRIEVERS:
            raise ValueError(f"retriever must be one of {', '.join(RETRIEVERS)} (got {kind!r})")
        if not chunks:
            raise ValueError("no chunks to retrieve from: the corpus is empty")
        self.chunks, self.kind = chunks, kind
        if kind == "bm25":
            self.bm25 = BM25.build([c.text for c in chunks])
            return
        self.model, self.tokenizer = model, tokenizer
        raw = np.stack([embed_text(model, tokenizer, c.text) for c in chunks])
        vectors, self.centroid = center(raw)
        self.index = faiss.IndexFlatIP(vectors.shape[1])
        self.index.add(vectors)

    def rank(self, question: str) -> list[int]:
        """Chunk indices, best first (ties by corpus order)."""
        if self.kind == "bm25":
            scores = self.bm25.scores(question)
        else:
            query = embed_text(self.model, self.tokenizer, question)
            found, ids = self.index.search(apply_centroid(query[None, :], self.centroid), len(self.chunks))
            scores = np.full(len(self.chunks), -np.inf)
            scores[ids[0]] = found[0]
        return [int(i) for i in np.argsort(-scores, kind="stable")]


def context_ids(tokenizer, chunks: list[Chunk]) -> list[int]:
    """The chunks, in document order, as one context turn."""
    ordered = sorted(chunks, key=lambda c: (c.doc, c.start))
    return system_ids(tokenizer, SEPARATOR.join(c.text for c in ordered))


def fill(tokenizer, chunks: list[Chunk], ranked: list[int], budget: int) -> tuple[list[Chunk], list[int]]:
    """The best-ranked chunks whose context fits in `budget` rows, and that context's ids.

    Goes down the ranking and keeps each chunk that still fits, so the context ends within
    one chunk of the budget (unless the corpus is smaller than it).
    """
    picked: list[Chunk] = []
    ids = context_ids(tokenizer, picked)
    if len(ids) > budget:
        raise ValueError(f"a budget of {budget} rows holds not even the empty context ({len(ids)} rows)")
    for i in ranked:
        trial = context_ids(tokenizer, [*picked, chunks[i]])
        if len(trial) <= budget:
            picked, ids = [*picked, chunks[i]], trial
    return sorted(picked, key=lambda c: (c.doc, c.start)), ids
