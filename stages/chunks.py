"""Chunks: plan the token spans that self-study quizzes the model about.

A span serves `per_chunk` consecutive conversations with distinct seed types
(chunk-major self-study): the bots and the teacher prefill its tokens once for
all of them. Every random choice comes from an RNG keyed by (seed, split, ...),
never from a running stream, so span j is the same whatever the number of
conversations planned. Held-out rows come first, so the plan of a larger run starts with
the whole plan of a smaller one, and the larger run takes over every full synthesis shard
the smaller one wrote (a time budget's pilot run, say).

Training spans tile the corpus in passes. One pass lays spans end to end over
every document from a random offset (`spans.tile`), so it covers every token at
least once, then shuffles the pass's spans across documents; passes follow one
another until the planned count is reached. A document thus gets spans in
proportion to its tokens, and every token is in at least as many training spans
as there are complete passes: with S spans planned and a pass holding at most
``P = sum over documents of (1 + ceil((tokens - 1) / chunk_min))`` spans, at
least ``floor(S / P)``.

Held-out spans (``heldout_region="sample"``, the default) are separately seeded
samples over the same documents: a document drawn by tokens, a uniform random
span anywhere in it, from the RNG keyed by split ``heldout``. No text is withheld
from training, so the held-out loss measures how well the cartridge answers new
questions about the corpus.

``heldout_region="tail"`` is the diagnostic of transfer to unseen text, and the
plan as it was before tiling: each document long enough to spare it reserves a
tail of ``max(ceil(0.1 * tokens), chunk_min)`` tokens, taken only when at least
``chunk_min`` tokens remain for training (a document needs ``2 * chunk_min``
tokens to have one). Training spans are uniform random spans before the tail,
held-out spans uniform random spans inside it, so they never overlap.
Documents too short to reserve are training-only; with ``heldout == 0`` nothing
is reserved.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from cartridges.core.errors import CorpusError
from cartridges.selfstudy import spans
from schemas import CHUNKS, ChunkConfig, ConfigError
from stages.ingest import tokenizer_identity
from stages.job import Job
from storage import Artifact, StageContext, StageResult, Store, StoreError, done_shards

NAME = "chunks"
VERSION = 3  # 2: training spans tile every document; held-out spans sampled over whole documents; 3: held-out rows first
HELDOUT_ID_BASE = 1_000_000_000  # chunk_id of held-out chunk i is HELDOUT_ID_BASE + i
SHARD_ROWS = 4096
DEFAULT_CONFIG = ChunkConfig()

Span = tuple[int, int, int, random.Random]  # doc_id, start, end, the RNG that picks its seed types


def heldout_reserve(tokens: int, config: ChunkConfig) -> int:
    """Tokens at the end of a document withheld from training: 0 unless ``heldout_region="tail"``."""
    if config.heldout_region != "tail":
        return 0
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
    if config.heldout and config.heldout_region == "tail" and not any(
            heldout_reserve(n, config) for _, n in lengths):
        longest = max(n for _, n in lengths)
        raise CorpusError(
            f"corpus too short for a held-out set: its longest document has {longest} tokens, "
            f"and held-out chunks need one document of at least {2 * config.chunk_min} tokens "
            f"(chunk_min={config.chunk_min} for training plus a reserved tail of at least "
            f"{config.chunk_min}); add text, lower chunk_min, set heldout to 0, "
            f"or use heldout_region 'sample'"
        )


def plan_spans(lengths: list[tuple[int, int]], config: ChunkConfig) -> list[dict]:
    """Rows of the ``chunks`` table without ``token_ids``, from (doc_id, tokens) pairs.

    Held-out rows come first (chunk_id = HELDOUT_ID_BASE + index), then train rows (chunk_id =
    index), so a plan is a prefix of every larger one with the same held-out count. Raises
    CorpusError when the corpus is empty or too short for a reserved tail.
    """
    lengths = [(int(d), int(n)) for d, n in lengths if n > 0]
    _check(lengths, config)
    if config.heldout_region == "tail":
        reserve = {d: heldout_reserve(n, config) for d, n in lengths}
        train = _sampler(lengths, config, "train", lambda d, n: (0, n - reserve[d]))
        held = _sampler([(d, n) for d, n in lengths if reserve[d]], config, "heldout",
                        lambda d, n: (n - reserve[d], n))
    else:
        train = _tiler(lengths, config)
        held = _sampler(lengths, config, "heldout", lambda d, n: (0, n))
    return _rows("heldout", config.heldout, config, held) + _rows("train", config.conversations, config, train)


def _sampler(pool: list[tuple[int, int]], config: ChunkConfig, split: str,
             region: Callable[[int, int], tuple[int, int]]) -> Callable[[int], Span]:
    """Span j: a document drawn by tokens, then a uniform random span inside its ``region``."""
    ids, weights = [d for d, _ in pool], [n for _, n in pool]
    total = dict(pool)

    def span(j: int) -> Span:
        rng = random.Random(chunk_seed(config.seed, split, j))
        doc = rng.choices(ids, weights=weights)[0]
        lo, hi = region(doc, total[doc])
        size = min(rng.randint(config.chunk_min, config.chunk_max), hi - lo)
        start = lo + rng.randint(0, hi - lo - size)
        return doc, start, start + size, rng

    return span


def _tiler(lengths: list[tuple[int, int]], config: ChunkConfig) -> Callable[[int], Span]:
    """Span j of the training passes: pass p tiles every document, its spans shuffled by (seed, p)."""
    laid: list[tuple[int, int, int]] = []
    passes = 0

    def lay_pass(p: int) -> list[tuple[int, int, int]]:
        tiles = []
        for d, n in lengths:
            rng = random.Random(spans.keyed_seed(config.seed, "train", "pass", p, d))
            tiles += [(d, a, b) for a, b in spans.tile(n, config.chunk_min, config.chunk_max, rng)]
        random.Random(spans.keyed_seed(config.seed, "train", "pass", p)).shuffle(tiles)
        return tiles

    def span(j: int) -> Span:
        nonlocal passes
        while len(laid) <= j:
            laid.extend(lay_pass(passes))
            passes += 1
        doc, start, end = laid[j]
        return doc, start, end, random.Random(chunk_seed(config.seed, "train", j))

    return span


def _rows(split: str, count: int, config: ChunkConfig, span_of: Callable[[int], Span]) -> list[dict]:
    """``count`` conversations of ``split``, ``per_chunk`` per span, each span's seed types distinct."""
    k = config.per_chunk
    rows = []
    for index in range(count):
        if index % k == 0:
            doc, start, end, rng = span_of(index // k)
            types = [rng.choice(config.seed_types)] if k == 1 else _seed_types(rng, config.seed_types, k)
        rows.append({
            "chunk_id": index if split == "train" else HELDOUT_ID_BASE + index,
            "doc_id": doc, "start": start, "end": end, "tokens": end - start,
            "seed_type": types[index % k], "split": split,
            "rng_seed": chunk_seed(config.seed, split, index),
        })
    return rows


def _seed_types(rng: random.Random, types: tuple[str, ...], k: int) -> list[str]:
    """`k` seed types for one span: all distinct while there are enough, then again from the start."""
    order = rng.sample(list(types), len(types))
    return [order[i % len(order)] for i in range(k)]


def train_coverage(lengths: list[tuple[int, int]], rows: list[dict], per_chunk: int) -> tuple[int, float]:
    """(min, mean) over all documents' tokens of how many training spans of ``rows`` hold each token."""
    seen = {}
    for r in rows:
        if r["split"] == "train":
            seen.setdefault(r["chunk_id"] // per_chunk, (r["doc_id"], r["start"], r["end"]))
    return spans.token_coverage(dict(lengths), seen.values())


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


def run(job: Job, config: ChunkConfig, documents: Artifact | StageResult) -> StageResult:
    """Plan train and held-out chunks over an ingest artifact; skipped when nothing changed."""
    store, tokenizer = job.store, job.tokenizer
    docs = _columns(store, documents, ["doc_id", "tokens"])
    planned = plan_spans([(d["doc_id"], d["tokens"]) for d in docs], config)
    fp_config = {**config.fingerprint_dict(), "tokenizer": job.model_id or tokenizer_identity(tokenizer)}

    def work(ctx: StageContext) -> None:
        done = ctx.done_shards()
        todo = [i for i in range(math.ceil(len(planned) / SHARD_ROWS)) if i not in done]
        if not todo:
            return
        needed = {r["doc_id"] for i in todo for r in planned[i * SHARD_ROWS:(i + 1) * SHARD_ROWS]}
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
            rows = [dict(r) for r in planned[i * SHARD_ROWS:(i + 1) * SHARD_ROWS]]
            for r in rows:
                r["token_ids"] = token_ids[r["doc_id"]][r["start"]: r["end"]]
            ctx.write_shard(i, pa.Table.from_pylist(rows, schema=CHUNKS))

    return store.run(NAME, VERSION, fp_config, [documents], work, force=job.forced(NAME), run_id=job.run_id)
