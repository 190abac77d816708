"""Held-out reference prefixes: the training region stops where held-out text begins."""

from __future__ import annotations

import pytest

from experiments.heldout_reference import references, training_region
from jobs.pipeline import run_pipeline
from schemas import ChunkConfig
from schemas.presets import preset
from stages.train import summary_of
from storage import Store, StoreError
from tests.tiny import tiny_llama

CORPUS = "Alpha beta gamma delta. The quick brown fox jumps over the lazy dog. " * 10


def test_training_region_covers_every_training_chunk_and_no_heldout_chunk(tmp_path):
    path = tmp_path / "corpus.md"
    path.write_text(CORPUS)
    lm, store = tiny_llama(), Store(tmp_path / "store")
    cfg = preset("smoke", {"synth": {"filter": False}, "chunks": {"heldout_region": "tail"}})
    run_pipeline(store, lm, [path], cfg)

    docs = store.table(store.latest("ingest")).to_pylist()
    region = lm.tokenizer(training_region(docs, cfg.chunks, lm.tokenizer), add_special_tokens=False)["input_ids"]
    doc_ids = lm.tokenizer(CORPUS, add_special_tokens=False)["input_ids"]
    assert region == doc_ids[: len(region)] and len(region) < len(doc_ids)
    chunks = store.table(store.latest("chunks")).to_pylist()
    assert max(c["end"] for c in chunks if c["split"] == "train") <= len(region)
    assert min(c["start"] for c in chunks if c["split"] == "heldout") >= len(region)

    out = references(store, lm)
    summary = summary_of(store, store.latest("train"))
    assert summary["init"] == "snapkv"  # "auto" on a model with one rotary
    assert summary["frozen"] == summary["p"] // 2  # the snapkv init's own frozen rows
    # The init reference is rebuilt here; the train stage scored the same cartridge on its own path.
    assert out["losses"]["init"] == pytest.approx(out["trained_init_loss"], rel=1e-5)
    assert out["losses"]["training_region"] != out["losses"]["whole_corpus"]
    with pytest.raises(StoreError, match="train-nope"):
        references(store, lm, "train-nope")


def test_training_region_is_the_whole_document_when_nothing_is_reserved():
    lm = tiny_llama()
    docs = [{"name": "a.md", "text": CORPUS}]
    assert training_region(docs, ChunkConfig(heldout=0, heldout_region="tail"), lm.tokenizer) == CORPUS
    # Sampled held-out chunks withhold nothing: the training region is the whole corpus.
    assert training_region(docs, ChunkConfig(heldout=16), lm.tokenizer) == CORPUS
