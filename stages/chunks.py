"""Chunks: plan the token spans that self-study quizzes the model about.

Each span is drawn with its own RNG keyed by (seed, split, span index), so span j
is the same whatever the number of chunks planned, and a larger run extends a
smaller one instead of reshuffling it. A span serves `per_chunk` consecutive
conversations with distinct seed types (chunk-major self-study): the bots and the
teacher prefill its tokens once for all of them.

Held-out chunks must never overlap training chunks, so each document long
enough to spare it reserves a tail: ``max(ceil(0.1 * tokens), chunk_min)``
tokens, taken only when at least ``chunk_min`` tokens remain for training (so a
tail is at most ``tokens - chunk_min``, and a document needs ``2 * chunk_min``
tokens to have one). Training spans come only from the part before the tail,
held-out spans only from inside it. Documents too short to reserve are
training-only; with ``heldout == 0`` nothing is reserved.
"""

from __future__ import annotations

import math
import random

import pyarrow as pa
import pyarrow.parquet as pq

from cartridges import spans
from cartridges.errors import CorpusError
from schemas import CHUNKS, ChunkConfig, ConfigError
from stages.ingest import tokenizer_identity
from storage import Artifact, StageContext, StageResult, Store, StoreError, done_shards

NAME = "chunks"
VERSION = 1
HELDOUT_ID_BASE = 1_000_000_000  # chunk_id of held-out chunk i is HELDOUT_ID_BASE + i
SHARD_ROWS = 4096
DEFAULT_CONFIG = ChunkConfig()


def heldout_reserve(tokens: int, config: ChunkConfig) -> int:
    """Tokens at the end of a document kept for held-out chunks; 0 when it cannot spare them."""
    return spans.heldout_reserve(tokens, config.chunk_min, config.heldout)


def chunk_seed(seed: int, split: str, index: int) -> int:
    """A non-negative int64 seed for one chunk (also usable by later stages for that chunk)."""
    return spans.keyed_seed(seed, split, index)


def _check(lengths: list[tuple[int, int]], config: ChunkConfig) -> None:
    if config.conversations >= HELDOUT_ID_BASE:
        raise ConfigError(
            f"ChunkConfig.conversations: must be < {HELDOUT_ID_BASE} "
            f"(got {config.conversations})"
        )
    if not lengths:
        raise CorpusError("corpus has no tokens: nothing to chunk")
    if config.heldout and not any(heldout_reserve(n, config) for _, n in lengths):
        longest = max(n for _, n in lengths)
        raise CorpusError(
            f"corpus too short for a held-out set: its longest document has {longest} tokens, "
            f"and held-out chunks need one document of at least {2 * config.chunk_min} tokens "
            f"(chunk_min={config.chunk_min} for training plus a reserved tail of at least "
            f"{config.chunk_min}); add text, lower chunk_min, or set heldout to 0"
        )


def plan_spans(lengths: list[tuple[int, int]], config: ChunkConfig) -> list[dict]:
    """Rows of the ``chunks`` table without ``token_ids``, from (doc_id, tokens) pairs.

    Train rows come first (chunk_id = index), then held-out rows. Raises
    CorpusError when the corpus is empty or too short for the held-out set.
    """
    lengths = [(int(d), int(n)) for d, n in lengths if n > 0]
    _check(lengths, config)
    reserve = {d: heldout_reserve(n, config) for d, n in lengths}
    total = {d: n for d, n in lengths}
    rows = []
    for split, count in (("train", config.conversations), ("heldout", config.heldout)):
        pool = lengths if split == "train" else [(d, n) for d, n in lengths if reserve[d]]
        ids = [d for d, _ in pool]
        weights = [n for _, n in pool]
        k = config.per_chunk
        for index in range(count):
            if index % k == 0:
                rng = random.Random(chunk_seed(config.seed, split, index // k))
                doc = rng.choices(ids, weights=weights)[0]
                if split == "train":
                    lo, hi = 0, total[doc] - reserve[doc]
                else:
                    lo, hi = total[doc] - reserve[doc], total[doc]
                size = min(rng.randint(config.chunk_min, config.chunk_max), hi - lo)
                start = lo + rng.randint(0, hi - lo - size)
                types = [rng.choice(config.seed_types)] if k == 1 else _seed_types(rng, config.seed_types, k)
            rows.append({
                "chunk_id": index if split == "train" else HELDOUT_ID_BASE + index,
                "doc_id": doc, "start": start, "end": start + size, "tokens": size,
                "seed_type": types[index % k], "split": split,
                "rng_seed": chunk_seed(config.seed, split, index),
            })
    return rows


def _seed_types(rng: random.Random, types: tuple[str, ...], k: int) -> list[str]:
    """`k` seed types for one span: all distinct while there are enough, then again from the start."""
    order = rng.sample(list(types), len(types))
    return [order[i % len(order)] for i in range(k)]


def plan_chunks(docs: list[dict], config: ChunkConfig) -> list[dict]:
    """Rows of the ``chunks`` table for documents given as dicts with doc_id and token_ids."""
    tokens = {int(d["doc_id"]): list(d["token_ids"]) for d in docs}
    rows = plan_spans([(d, len(ids)) for d, ids in tokens.items()], config)
    for row in rows:
        row["token_ids"] = tokens[row["doc_id"]][row["start"]: row["end"]]
    return rows


def _columns(store: Store, documents: Artifact | StageResult, columns: list[str]) -> list[dict]:
    """Just ``columns`` of the documents table (the planner needs no text)."""
    directory = store.dir(documents)
    if not directory.is_dir():
        raise StoreError(f"{directory}: documents artifact has no directory "
                         "(garbage-collected or deleted?); rerun ingest", directory)
    out: list[dict] = []
    for path in done_shards(directory).values():
        try:
            out += pq.read_table(path, columns=columns).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise StoreError(f"{path}: cannot read documents shard ({e}); rerun ingest "
                             "with force to rewrite it", path) from e
    return out


def run(store: Store, documents: Artifact | StageResult, tokenizer,
        config: ChunkConfig = DEFAULT_CONFIG, force: bool = False, run_id: str | None = None,
        tokenizer_id: str | None = None) -> StageResult:
    """Plan train and held-out chunks over an ingest artifact; skipped when nothing changed."""
    docs = _columns(store, documents, ["doc_id", "tokens"])
    spans = plan_spans([(d["doc_id"], d["tokens"]) for d in docs], config)
    fp_config = {**config.to_dict(), "tokenizer": tokenizer_id or tokenizer_identity(tokenizer)}

    def work(ctx: StageContext) -> None:
        done = ctx.done_shards()
        todo = [i for i in range(math.ceil(len(spans) / SHARD_ROWS)) if i not in done]
        if not todo:
            return
        needed = {r["doc_id"] for i in todo for r in spans[i * SHARD_ROWS:(i + 1) * SHARD_ROWS]}
        token_ids: dict[int, list[int]] = {}
        for d in _columns(store, documents, ["doc_id", "name", "tokens", "text"]):
            if d["doc_id"] not in needed:
                continue
            ids = tokenizer(d["text"], add_special_tokens=False)["input_ids"]
            if len(ids) != d["tokens"]:
                raise CorpusError(
                    f"document {d['name']!r}: tokenizes to {len(ids)} tokens here but "
                    f"{d['tokens']} at ingest; chunk with the tokenizer used for ingest"
                )
            token_ids[d["doc_id"]] = [int(t) for t in ids]
        for i in todo:
            rows = [dict(r) for r in spans[i * SHARD_ROWS:(i + 1) * SHARD_ROWS]]
            for r in rows:
                r["token_ids"] = token_ids[r["doc_id"]][r["start"]: r["end"]]
            ctx.write_shard(i, pa.Table.from_pylist(rows, schema=CHUNKS))

    return store.run(NAME, VERSION, fp_config, [documents], work, force=force, run_id=run_id)
