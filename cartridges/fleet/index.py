"""The retrieval index: document chunks embedded through the serving model itself.

Contract (index chunks and queries embed identically): the text's tokens, then a
one-line topic instruction; the embedding is the final-norm hidden state of the last
token, L2-normalized, centered by the centroid of the index's chunk embeddings (stored
and applied to queries too), and renormalized. A faiss inner-product index over the
chunks. A small model's hidden states tell documents on one subject apart poorly, so
a chunk's score adds its BM25 score over the chunk's words, scaled so the query's
best chunk gets `LEXICAL_WEIGHT`; the top chunks dedupe to documents in best-chunk
order.

A corrupted faiss file can crash the reader instead of raising, so every index file's
sha256 is kept in the manifest and checked before faiss reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cartridges.core.errors import FleetError
from cartridges.core.similarity import (
    BM25,
    SUFFIX,
    apply_centroid,
    center,
    embed_ids,
    suffix_ids,
)
from schemas import TABLES, validate_table
from storage.atomic import atomic_path
from storage.faults import fault_point
from storage.fingerprint import sha256_file

LEXICAL_WEIGHT = 1.0
FILES = {"faiss": "index.faiss", "chunks": "index_chunks.parquet", "centroid": "index_centroid.npy"}


def contract(embed_chunk: int) -> dict:
    """What the manifest records so a reader embeds queries the same way."""
    return {"suffix": SUFFIX, "pooling": "final-norm hidden state of the last token",
            "normalize": "l2, minus chunk centroid, l2", "embed_chunk": embed_chunk}


def chunk_spans(n_tokens: int, size: int) -> list[tuple[int, int]]:
    return [(s, min(s + size, n_tokens)) for s in range(0, n_tokens, size)]


def build_index(model, tokenizer, documents: list[dict], embed_chunk: int, directory: Path,
                progress=None) -> dict:
    """Embed every document's chunks, write the index files atomically; returns the manifest entry.

    `documents`: dicts with doc_id, name and text.
    """
    suffix = suffix_ids(tokenizer)
    rows, raw = [], []
    for doc in documents:
        ids = list(tokenizer(doc["text"], add_special_tokens=False)["input_ids"])
        for start, end in chunk_spans(len(ids), embed_chunk):
            raw.append(embed_ids(model, ids[start:end] + suffix))
            rows.append({"chunk_id": len(rows), "doc_id": int(doc["doc_id"]), "doc_name": doc["name"],
                         "start": start, "end": end, "text": tokenizer.decode(ids[start:end])})
            if progress:
                progress(1)
    if not rows:
        raise FleetError("no text to index: every document is empty")
    vectors, centroid = center(np.stack(raw))
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    directory = Path(directory)
    with atomic_path(directory / FILES["faiss"]) as tmp:
        faiss.write_index(index, str(tmp))
    fault_point("fleet.index.faiss")
    table = validate_table("index_chunks", pa.Table.from_pylist(rows, schema=TABLES["index_chunks"]))
    with atomic_path(directory / FILES["chunks"]) as tmp:
        pq.write_table(table, tmp)
    fault_point("fleet.index.chunks")
    with atomic_path(directory / FILES["centroid"]) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, centroid, allow_pickle=False)
    entry = {"n_chunks": len(rows), "dim": int(vectors.shape[1]), **contract(embed_chunk)}
    for key, name in FILES.items():
        entry[key] = name
        entry[f"{key}_sha256"] = sha256_file(directory / name)
    return entry


@dataclass
class Index:
    index: faiss.Index
    centroid: np.ndarray
    chunk_docs: list[str]  # document name of each chunk id
    lexical: BM25 | None = None

    @classmethod
    def open(cls, directory: Path, entry: dict) -> Index:
        directory = Path(directory)
        paths = {}
        for key in FILES:
            path = directory / entry[key]
            if not path.is_file():
                raise FleetError(f"{path}: retrieval index file is missing; rebuild it with --rounds 0 --resume")
            if sha256_file(path) != entry[f"{key}_sha256"]:
                raise FleetError(f"{path}: checksum mismatch, the retrieval index is corrupted; "
                                 "rebuild it with --rounds 0 --resume")
            paths[key] = path
        index = faiss.read_index(str(paths["faiss"]))
        centroid = np.load(paths["centroid"], allow_pickle=False)
        docs = pq.read_table(paths["chunks"], columns=["chunk_id", "doc_name", "text"]).to_pydict()
        order = np.argsort(np.asarray(docs["chunk_id"]))
        names = [docs["doc_name"][i] for i in order]
        if index.ntotal != len(names) or centroid.shape != (index.d,):
            raise FleetError(f"{directory}: index files disagree ({index.ntotal} vectors, {len(names)} chunks)")
        return cls(index, centroid.astype(np.float32), names, BM25.build([docs["text"][i] for i in order]))

    def search(self, query_vector: np.ndarray, k_docs: int, k_chunks: int,
               query: str = "") -> list[tuple[str, float]]:
        """Top chunks by embedding plus lexical score, deduped to documents in best-chunk order:
        (name, best chunk score)."""
        q = apply_centroid(query_vector[None, :], self.centroid)
        found, ids = self.index.search(q, self.index.ntotal)
        scores = np.full(self.index.ntotal, -np.inf)
        valid = ids[0] >= 0
        scores[ids[0][valid]] = found[0][valid]
        if self.lexical is not None and query:
            lexical = self.lexical.scores(query)
            if lexical.max() > 0:
                scores = scores + LEXICAL_WEIGHT * lexical / lexical.max()
        out: dict[str, float] = {}
        for i in np.argsort(-scores, kind="stable")[: min(max(k_chunks, 1), self.index.ntotal)]:
            name = self.chunk_docs[int(i)]
            if name not in out and np.isfinite(scores[i]):
                out[name] = float(scores[i])
        return list(out.items())[:k_docs]
