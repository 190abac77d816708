"""Ingest and chunk planning: content fingerprints, versions, bad input, keyed sampling, coverage."""

from __future__ import annotations

import hashlib
import math
import random
from collections import Counter
from pathlib import Path

import pytest

from cartridges.core.errors import CorpusError
from cartridges.selfstudy import spans
from schemas import SEED_TYPES, ChunkConfig, IngestConfig
from stages import chunks, ingest
from stages.chunks import HELDOUT_ID_BASE, heldout_reserve, plan_chunks, plan_spans, train_coverage
from stages.job import Job
from storage import Store
from tests.tiny import tiny_tokenizer


def job(store: Store, tok, paths=(), **kwargs) -> Job:
    """A job with only a tokenizer: ingest and chunks run no model."""
    return Job(store, corpus=tuple(paths), tokenizer=tok, **kwargs)

WORDS = "deflate window huffman literal length distance block stored fixed dynamic".split()


def _text(n_bytes: int, salt: int = 0) -> str:
    words = [WORDS[(i * 7 + salt) % len(WORDS)] for i in range(n_bytes // 4 + 1)]
    return " ".join(words)[:n_bytes]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(tmp_path / "store")


@pytest.fixture
def corpus(tmp_path) -> Path:
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "b.md").write_text(_text(3000, 1))
    (d / "a.txt").write_text(_text(2000, 2))
    (d / "sub" / "c.md").write_text(_text(1500, 3))
    (d / "skip.rst").write_text("not a corpus file")
    return d


def _docs(store: Store, result) -> list[dict]:
    return store.table(result).to_pylist()


def _complete(store: Store, stage: str) -> list:
    return [a for a in store.catalog.artifacts(stage) if a.status == "complete"]


# ---------------------------------------------------------------- ingest


def test_ingest_directory(store, corpus, tok):
    result = ingest.run(job(store, tok, [corpus]))
    assert not result.skipped and result.status == "complete" and result.rows == 3
    docs = _docs(store, result)
    assert [d["doc_id"] for d in docs] == [0, 1, 2]
    assert [d["name"] for d in docs] == ["a.txt", "b.md", "sub/c.md"]
    for d in docs:
        data = Path(d["path"]).read_bytes()
        assert d["sha256"] == hashlib.sha256(data).hexdigest()
        assert d["text"] == data.decode()
        assert d["chars"] == len(d["text"])
        assert d["tokens"] == len(data)  # tiny tokenizer: one token per byte
        assert d["version"] == 1


def test_ingest_files_in_sorted_path_order(store, corpus, tok):
    result = ingest.run(job(store, tok, [corpus / "b.md", str(corpus / "a.txt")]))
    docs = _docs(store, result)
    assert [(d["doc_id"], d["name"]) for d in docs] == [(0, "a.txt"), (1, "b.md")]


def test_unchanged_rerun_is_skipped_even_when_touched(store, corpus, tok):
    first = ingest.run(job(store, tok, [corpus]))
    (corpus / "a.txt").write_text((corpus / "a.txt").read_text())  # new mtime, same bytes
    again = ingest.run(job(store, tok, [corpus]))
    assert again.skipped and again.id == first.id
    assert ingest.run(job(store, tok, [corpus], force=frozenset({"ingest"}))).id == first.id
    assert [d["version"] for d in _docs(store, first)] == [1, 1, 1]


def test_tokenizer_identity_is_part_of_the_fingerprint(store, corpus, tok):
    first = ingest.run(job(store, tok, [corpus], model_id="model-a"))
    assert ingest.run(job(store, tok, [corpus], model_id="model-a")).skipped
    other = ingest.run(job(store, tok, [corpus], model_id="model-b"))
    assert not other.skipped and other.id != first.id
    assert ingest.tokenizer_identity(tok) == ingest.tokenizer_identity(tiny_tokenizer())


def test_changed_file_gets_new_artifact_and_version(store, corpus, tok):
    first = ingest.run(job(store, tok, [corpus]))
    (corpus / "b.md").write_text(_text(3000, 5))
    second = ingest.run(job(store, tok, [corpus]))
    assert not second.skipped and second.id != first.id
    versions = {d["name"]: d["version"] for d in _docs(store, second)}
    assert versions == {"a.txt": 1, "b.md": 2, "sub/c.md": 1}
    (corpus / "b.md").write_text(_text(3000, 6))
    (corpus / "new.md").write_text(_text(500, 7))
    third = ingest.run(job(store, tok, [corpus]))
    versions = {d["name"]: d["version"] for d in _docs(store, third)}
    assert versions == {"a.txt": 1, "b.md": 3, "new.md": 1, "sub/c.md": 1}
    assert len(_complete(store, "ingest")) == 3


def _bad_inputs(tmp: Path) -> list[tuple[list, IngestConfig, str]]:
    tmp.mkdir()
    (tmp / "bin.md").write_bytes(b"abc\x00def")
    (tmp / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (tmp / "empty.md").write_text(" \n\t\n")
    (tmp / "big.md").write_text("x" * 200)
    (tmp / "ok.md").write_text("fine text here")
    (tmp / "nodocs").mkdir()
    (tmp / "nodocs" / "x.rst").write_text("rst only")
    (tmp / "dup1").mkdir()
    (tmp / "dup1" / "ok.md").write_text("another file with the same name")
    default = IngestConfig()
    return [
        ([tmp / "missing.md"], default, "missing.md: no such file"),
        ([tmp / "ok.md", tmp / "gone"], default, "gone: no such file"),
        ([tmp / "bin.md"], default, "bin.md: binary file"),
        ([tmp / "latin1.txt"], default, "latin1.txt: not valid UTF-8"),
        ([tmp / "empty.md"], default, "empty.md: empty file"),
        ([tmp / "big.md"], IngestConfig(max_bytes=100), "big.md: 200 bytes is over the 100-byte"),
        ([tmp / "nodocs"], default, "nodocs: directory has no"),
        ([tmp / "ok.md", tmp / "dup1"], default, "document name 'ok.md' is also used"),
        ([], default, "no corpus paths"),
    ]


def test_bad_inputs_raise_before_any_artifact(store, tmp_path, tok):
    for paths, config, message in _bad_inputs(tmp_path / "bad"):
        with pytest.raises(CorpusError, match=message):
            ingest.run(job(store, tok, paths), config)
        assert store.latest("ingest") is None
        assert store.catalog.artifacts("ingest") == []


def test_bad_file_among_good_ones_names_it(store, corpus, tok):
    (corpus / "zz.md").write_bytes(b"\xff\xfe bad bytes")
    with pytest.raises(CorpusError, match=r"zz\.md: not valid UTF-8"):
        ingest.run(job(store, tok, [corpus]))
    assert store.catalog.artifacts("ingest") == []


# ---------------------------------------------------------------- chunk plans


def _docs_of(lengths: list[int]) -> list[dict]:
    return [{"doc_id": i, "token_ids": [(i * 1000 + t) % 250 for t in range(n)]}
            for i, n in enumerate(lengths)]


CFG = ChunkConfig(conversations=40, heldout=6, chunk_min=32, chunk_max=64, seed=3, per_chunk=1)
TAIL = CFG.replace(heldout_region="tail")


def test_plan_is_deterministic_and_seeded():
    docs = _docs_of([2000, 900, 400])
    a, b = plan_chunks(docs, CFG), plan_chunks(docs, CFG)
    assert a == b
    other = plan_chunks(docs, CFG.replace(seed=4))
    assert [(r["doc_id"], r["start"], r["end"]) for r in other] != [
        (r["doc_id"], r["start"], r["end"]) for r in a]


def test_chunk_i_does_not_depend_on_the_number_of_chunks():
    docs = _docs_of([2000, 900, 400])
    small = plan_chunks(docs, CFG.replace(conversations=10))
    large = plan_chunks(docs, CFG.replace(conversations=20))
    train_small = [r for r in small if r["split"] == "train"]
    train_large = [r for r in large if r["split"] == "train"]
    assert train_small == train_large[:10]
    assert [r for r in small if r["split"] == "heldout"] == [
        r for r in large if r["split"] == "heldout"]
    assert large[: len(small)] == small  # the whole smaller plan: a larger run takes over its shards


def test_rows_are_well_formed():
    docs = _docs_of([2000, 900, 400])
    rows = plan_chunks(docs, CFG)
    train = [r for r in rows if r["split"] == "train"]
    held = [r for r in rows if r["split"] == "heldout"]
    assert len(train) == 40 and len(held) == 6
    assert [r["chunk_id"] for r in train] == list(range(40))
    assert [r["chunk_id"] for r in held] == [HELDOUT_ID_BASE + i for i in range(6)]
    assert len({r["rng_seed"] for r in rows}) == len(rows)
    for r in rows:
        assert CFG.chunk_min <= r["tokens"] <= CFG.chunk_max
        assert r["tokens"] == r["end"] - r["start"] == len(r["token_ids"])
        assert r["token_ids"] == docs[r["doc_id"]]["token_ids"][r["start"]: r["end"]]
        assert r["seed_type"] in SEED_TYPES
        assert 0 <= r["rng_seed"] < 2**63


def test_tail_heldout_spans_never_overlap_train_spans():
    docs = _docs_of([3000, 1200, 60, 20])
    rows = plan_chunks(docs, TAIL.replace(conversations=300, heldout=50))
    train = [r for r in rows if r["split"] == "train"]
    held = [r for r in rows if r["split"] == "heldout"]
    for h in held:
        assert heldout_reserve(len(docs[h["doc_id"]]["token_ids"]), TAIL) > 0
        for t in train:
            if t["doc_id"] == h["doc_id"]:
                assert t["end"] <= h["start"] or h["end"] <= t["start"], (t, h)
    # Short documents are training-only; a document shorter than chunk_min is one whole chunk.
    assert not [h for h in held if h["doc_id"] in (2, 3)]
    tiny = [t for t in train if t["doc_id"] == 3]
    assert tiny and all((t["start"], t["end"]) == (0, 20) for t in tiny)


def test_chunk_major_plan_gives_each_span_distinct_seed_types():
    docs = _docs_of([3000, 1200])
    cfg = CFG.replace(conversations=42, heldout=8, per_chunk=4)
    rows = plan_chunks(docs, cfg)
    for split in ("train", "heldout"):
        part = [r for r in rows if r["split"] == split]
        spans = [part[i : i + 4] for i in range(0, len(part), 4)]
        assert len(spans) == -(-len(part) // 4)
        for span in spans:
            assert len({(r["doc_id"], r["start"], r["end"]) for r in span}) == 1
            assert len({r["seed_type"] for r in span}) == len(span)
        assert len({(s[0]["doc_id"], s[0]["start"]) for s in spans}) == len(spans)
    assert len({r["rng_seed"] for r in rows}) == len(rows)
    # A larger plan extends a smaller one: the same spans and seeds for the first conversations.
    smaller = plan_chunks(docs, cfg.replace(conversations=20))
    assert [r for r in smaller if r["split"] == "train"] == [r for r in rows if r["split"] == "train"][:20]


def test_one_conversation_per_chunk_is_the_classic_plan():
    docs = _docs_of([3000])
    one = plan_chunks(docs, CFG.replace(per_chunk=1))
    assert len({(r["start"], r["end"]) for r in one if r["split"] == "train"}) > 30


def test_reserved_tail_sizes():
    assert heldout_reserve(3000, TAIL) == 300  # 10% of the document
    assert heldout_reserve(400, TAIL) == 40  # 10%, above chunk_min
    assert heldout_reserve(100, TAIL) == 32  # at least chunk_min
    assert heldout_reserve(64, TAIL) == 32  # exactly 2 * chunk_min: both parts fit
    assert heldout_reserve(63, TAIL) == 0  # too short to spare a tail
    assert heldout_reserve(3000, TAIL.replace(heldout=0)) == 0
    assert heldout_reserve(3000, CFG) == 0  # sampled held-out spans withhold nothing


def test_a_reserved_tail_needs_a_long_enough_document():
    with pytest.raises(CorpusError, match=r"too short for a held-out set.*63 tokens.*at least 64"):
        plan_chunks(_docs_of([63, 20]), TAIL)
    # Sampled held-out spans need no spare text: they may lie anywhere, even in a short document.
    held = [r for r in plan_chunks(_docs_of([63, 20]), CFG) if r["split"] == "heldout"]
    assert len(held) == CFG.heldout
    # Without a held-out set a short corpus is fine: a document under chunk_min is one chunk.
    rows = plan_chunks(_docs_of([30, 20]), CFG.replace(heldout=0))
    assert {(r["doc_id"], r["start"], r["end"]) for r in rows} == {(0, 0, 30), (1, 0, 20)}
    with pytest.raises(CorpusError, match="no tokens"):
        plan_chunks([], CFG)


def test_seed_types_roughly_uniform():
    rows = plan_chunks(_docs_of([5000]), CFG.replace(conversations=140, heldout=0))
    counts = Counter(r["seed_type"] for r in rows)
    assert set(counts) == set(SEED_TYPES)
    assert all(8 <= c <= 35 for c in counts.values()), counts
    only = plan_chunks(_docs_of([5000]), CFG.replace(seed_types=("question", "verbatim")))
    assert {r["seed_type"] for r in only} == {"question", "verbatim"}


def test_documents_drawn_in_proportion_to_tokens():
    rows = plan_spans([(0, 6000), (1, 3000), (2, 1000)], CFG.replace(conversations=2000))
    counts = Counter(r["doc_id"] for r in rows if r["split"] == "train")
    assert abs(counts[0] / 2000 - 0.6) < 0.05
    assert abs(counts[1] / 2000 - 0.3) < 0.05
    assert abs(counts[2] / 2000 - 0.1) < 0.03


def _plan_before_tiling(lengths: list[tuple[int, int]], config: ChunkConfig) -> list[dict]:
    """The planner as it was before tiling (uniform random spans, reserved tails), kept as the reference."""
    lengths = [(int(d), int(n)) for d, n in lengths if n > 0]
    reserve = {d: spans.heldout_reserve(n, config.chunk_min, config.heldout) for d, n in lengths}
    total = {d: n for d, n in lengths}
    rows = []
    for split, count in (("train", config.conversations), ("heldout", config.heldout)):
        pool = lengths if split == "train" else [(d, n) for d, n in lengths if reserve[d]]
        ids = [d for d, _ in pool]
        weights = [n for _, n in pool]
        k = config.per_chunk
        for index in range(count):
            if index % k == 0:
                rng = random.Random(spans.keyed_seed(config.seed, split, index // k))
                doc = rng.choices(ids, weights=weights)[0]
                if split == "train":
                    lo, hi = 0, total[doc] - reserve[doc]
                else:
                    lo, hi = total[doc] - reserve[doc], total[doc]
                size = min(rng.randint(config.chunk_min, config.chunk_max), hi - lo)
                start = lo + rng.randint(0, hi - lo - size)
                if k == 1:
                    types = [rng.choice(config.seed_types)]
                else:
                    order = rng.sample(list(config.seed_types), len(config.seed_types))
                    types = [order[i % len(order)] for i in range(k)]
            rows.append({
                "chunk_id": index if split == "train" else HELDOUT_ID_BASE + index,
                "doc_id": doc, "start": start, "end": start + size, "tokens": size,
                "seed_type": types[index % k], "split": split,
                "rng_seed": spans.keyed_seed(config.seed, split, index),
            })
    return rows


@pytest.mark.parametrize("per_chunk", [1, 4])
def test_tail_region_is_exactly_the_plan_before_tiling(per_chunk):
    lengths = [(0, 3000), (1, 1200), (2, 60), (3, 20)]
    cfg = TAIL.replace(conversations=90, heldout=10, per_chunk=per_chunk)
    before = _plan_before_tiling(lengths, cfg)  # train rows first then; held-out rows lead the plan now
    assert plan_spans(lengths, cfg) == [r for r in before if r["split"] == "heldout"] + [
        r for r in before if r["split"] == "train"]
    # Pinned: the first training row and the last held-out row the planner gave before tiling.
    rows = plan_spans(lengths, TAIL)
    first, last = [r for r in rows if r["split"] == "train"][0], [r for r in rows if r["split"] == "heldout"][-1]
    assert [(r["doc_id"], r["start"], r["end"], r["seed_type"]) for r in (first, last)] == [
        (0, 573, 626, "use_case"), (1, 1130, 1194, "structuring")]


def _depths(lengths: dict[int, int], rows: list[dict], per_chunk: int) -> dict[int, list[int]]:
    """How many distinct training spans hold each token, counted token by token."""
    depth = {d: [0] * n for d, n in lengths.items()}
    seen = set()
    for r in rows:
        if r["split"] == "train" and r["chunk_id"] // per_chunk not in seen:
            seen.add(r["chunk_id"] // per_chunk)
            for t in range(r["start"], r["end"]):
                depth[r["doc_id"]][t] += 1
    return depth


@pytest.mark.parametrize("per_chunk", [1, 4])
def test_every_token_is_in_at_least_as_many_training_spans_as_complete_passes(per_chunk):
    lengths = {0: 2000, 1: 900, 2: 400, 3: 20, 4: 33}
    cfg = CFG.replace(per_chunk=per_chunk, heldout=0)
    # A pass over a document holds at most 1 + ceil((n - 1) / chunk_min) spans.
    per_pass = sum(1 + math.ceil((n - 1) / cfg.chunk_min) for n in lengths.values())
    for passes in (1, 2, 5):
        span_count = passes * per_pass
        rows = plan_spans(list(lengths.items()), cfg.replace(conversations=span_count * per_chunk))
        depth = _depths(lengths, rows, per_chunk)
        lowest = min(min(d) for d in depth.values())
        assert lowest >= passes
        mean = sum(sum(d) for d in depth.values()) / sum(lengths.values())
        assert train_coverage(list(lengths.items()), rows, per_chunk) == (lowest, pytest.approx(mean))
        sizes = {(r["chunk_id"] // per_chunk): r["tokens"] for r in rows}
        assert mean == pytest.approx(sum(sizes.values()) / sum(lengths.values()))
    # Uniform random spans leave tokens uncovered at the same budget (the edges of each document).
    old = _plan_before_tiling(list(lengths.items()), cfg.replace(conversations=per_pass * per_chunk))
    assert min(min(d) for d in _depths(lengths, old, per_chunk).values()) == 0


def test_tiles_lay_spans_end_to_end_over_the_whole_document():
    for n, seed in [(1000, 0), (1000, 1), (65, 2), (64, 3), (31, 4), (500, 5)]:
        tiles = spans.tile(n, 32, 64, random.Random(seed))
        assert len(tiles) <= 1 + math.ceil((n - 1) / 32)
        assert tiles[0][0] == 0 and tiles[-1][1] == n
        for (_, b), (c, _) in zip(tiles, tiles[1:], strict=False):
            assert c <= b  # no gap between neighbours
        for a, b in tiles:
            assert 0 <= a < b <= n and (min(32, n) <= b - a <= 64)
        interior = tiles[1:-1]
        assert all(x[1] == y[0] for x, y in zip(interior, interior[1:], strict=False))


def test_a_larger_plan_extends_a_smaller_one_across_passes():
    lengths = [(0, 700), (1, 300)]
    cfg = CFG.replace(per_chunk=4)
    small = plan_spans(lengths, cfg.replace(conversations=10))
    large = plan_spans(lengths, cfg.replace(conversations=400))  # several passes
    train = [r for r in large if r["split"] == "train"]
    assert [r for r in small if r["split"] == "train"] == train[:10]
    assert [r for r in small if r["split"] == "heldout"] == [r for r in large if r["split"] == "heldout"]


def test_sampled_heldout_spans_come_from_their_own_keyed_rng_anywhere_in_the_document():
    lengths = [(0, 3000), (1, 1200)]
    cfg = CFG.replace(heldout=40)
    held = [r for r in plan_spans(lengths, cfg) if r["split"] == "heldout"]
    for j, r in enumerate(held):
        rng = random.Random(spans.keyed_seed(cfg.seed, "heldout", j))
        doc = rng.choices([0, 1], weights=[3000, 1200])[0]
        size = rng.randint(cfg.chunk_min, cfg.chunk_max)
        start = rng.randint(0, dict(lengths)[doc] - size)
        assert (r["doc_id"], r["start"], r["end"]) == (doc, start, start + size)
    assert any(r["end"] <= 0.9 * dict(lengths)[r["doc_id"]] for r in held)  # not confined to a tail
    # Held-out draws leave the training plan alone.
    train = [r for r in plan_spans(lengths, cfg) if r["split"] == "train"]
    assert train == [r for r in plan_spans(lengths, cfg.replace(heldout=0)) if r["split"] == "train"]


# ---------------------------------------------------------------- chunks stage


def test_chunks_stage_skips_and_recomputes(store, corpus, tok):
    cfg = ChunkConfig(conversations=12, heldout=3, chunk_min=64, chunk_max=128)
    docs = ingest.run(job(store, tok, [corpus]))
    first = chunks.run(job(store, tok), cfg, docs)
    assert not first.skipped and first.rows == 15
    rows = store.table(first).to_pylist()
    texts = {d["doc_id"]: d["text"] for d in _docs(store, docs)}
    for r in rows:
        assert tok.decode(r["token_ids"]) == texts[r["doc_id"]].encode()[r["start"]: r["end"]].decode()
    plan = plan_chunks(
        [{"doc_id": d, "token_ids": tok(t, add_special_tokens=False)["input_ids"]}
         for d, t in texts.items()], cfg)
    assert rows == plan

    docs_again = ingest.run(job(store, tok, [corpus]))
    again = chunks.run(job(store, tok), cfg, docs_again)
    assert docs_again.skipped and again.skipped and again.id == first.id

    wider = chunks.run(job(store, tok), cfg.replace(chunk_max=200), ingest.run(job(store, tok, [corpus])))
    assert not wider.skipped and wider.id != first.id
    assert max(r["tokens"] for r in store.table(wider).to_pylist()) <= 200
    assert store.latest("ingest").id == docs.id
    assert len(_complete(store, "chunks")) == 2


def test_chunks_follow_a_changed_corpus(store, corpus, tok):
    cfg = ChunkConfig(conversations=8, heldout=2, chunk_min=64, chunk_max=128)
    first = chunks.run(job(store, tok), cfg, ingest.run(job(store, tok, [corpus])))
    (corpus / "a.txt").write_text(_text(2000, 9))
    second = chunks.run(job(store, tok), cfg, ingest.run(job(store, tok, [corpus])))
    assert not second.skipped and second.id != first.id


def test_corpus_too_short_for_a_tail_leaves_no_artifact_but_samples_fine(store, tmp_path, tok):
    (tmp_path / "short.md").write_text("only a few words")
    docs = ingest.run(job(store, tok, [tmp_path / "short.md"]))
    with pytest.raises(CorpusError, match="too short for a held-out set.*512 tokens"):
        chunks.run(job(store, tok), ChunkConfig(heldout_region="tail"), docs)
    assert store.catalog.artifacts("chunks") == []
    assert chunks.run(job(store, tok), ChunkConfig(), docs).rows == ChunkConfig().conversations + ChunkConfig().heldout
