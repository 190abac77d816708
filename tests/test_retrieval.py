"""Retrieval arms on a tiny model: the rows they hold, the chunks they pick and their order,
and the untrained `first` rows as the same computation as the truncated document in context."""

from __future__ import annotations

import pytest
import torch

from cartridges.core.chat import system_ids
from cartridges.core.compress import first_rows
from cartridges.core.prefix import capture_rows
from cartridges.evaluation.retrieval import Chunk, Retriever, context_ids, corpus_chunks, fill
from tests.tiny import tiny_llama

DOCS = [
    "Alpha river flows north past the mill. " * 3 + "The quokka festival is held in June. " + "Hills rise. " * 4,
    "Beta town trades wool and salt. " * 4 + "Its bell tower has nine bells. " + "Roads wind. " * 3,
    "Gamma lake is cold and deep. " * 5,
]


@pytest.fixture(scope="module")
def lm():
    return tiny_llama()


def test_chunks_tile_every_document_in_order(lm):
    chunks = corpus_chunks(lm.tokenizer, DOCS, 20)
    for d, text in enumerate(DOCS):
        mine = [c for c in chunks if c.doc == d]
        n = len(lm.tokenizer(text, add_special_tokens=False)["input_ids"])
        assert [(c.start, c.end) for c in mine] == [(s, min(s + 20, n)) for s in range(0, n, 20)]
        assert "".join(c.text for c in mine) == text  # byte-level tokens decode back exactly
    with pytest.raises(ValueError, match="chunk size"):
        corpus_chunks(lm.tokenizer, DOCS, 0)


@pytest.mark.parametrize("budget", [60, 90, 150])
def test_fill_holds_at_most_the_budget_and_no_further_chunk_fits(lm, budget):
    chunks = corpus_chunks(lm.tokenizer, DOCS, 16)
    ranked = Retriever(chunks, "bm25").rank("When is the quokka festival held?")
    picked, ids = fill(lm.tokenizer, chunks, ranked, budget)
    assert ids == context_ids(lm.tokenizer, picked) and len(ids) <= budget
    assert [(c.doc, c.start) for c in picked] == sorted((c.doc, c.start) for c in picked)  # document order
    for c in chunks:
        if c not in picked:
            assert len(context_ids(lm.tokenizer, [*picked, c])) > budget
    # within one chunk (and its separator) of the budget
    assert budget - len(ids) < max(len(lm.tokenizer(c.text)["input_ids"]) for c in chunks) + 2


def test_bm25_puts_the_chunk_with_the_questions_rare_words_first(lm):
    chunks = corpus_chunks(lm.tokenizer, DOCS, 16)
    best = chunks[Retriever(chunks, "bm25").rank("quokka festival")[0]]
    assert "quokka" in best.text or "festival" in best.text
    picked, _ = fill(lm.tokenizer, chunks, Retriever(chunks, "bm25").rank("nine bells tower"), 80)
    assert any("bells" in c.text for c in picked)


def test_dense_ranks_a_chunk_first_for_its_own_text(lm):
    chunks = corpus_chunks(lm.tokenizer, DOCS, 24)
    dense = Retriever(chunks, "dense", lm.model, lm.tokenizer)
    for i in (0, 3, len(chunks) - 1):
        assert dense.rank(chunks[i].text)[0] == i


def test_context_is_one_system_turn_of_the_chunks_in_document_order(lm):
    a, b = Chunk(1, 0, 3, "bbb"), Chunk(0, 5, 8, "aaa")
    assert context_ids(lm.tokenizer, [a, b]) == system_ids(lm.tokenizer, "aaa\n\nbbb")


def test_a_budget_below_the_empty_context_is_a_clear_error(lm):
    chunks = corpus_chunks(lm.tokenizer, DOCS, 16)
    with pytest.raises(ValueError, match="not even the empty context"):
        fill(lm.tokenizer, chunks, list(range(len(chunks))), 3)


def test_first_rows_are_the_truncated_context_in_context(lm):
    """`first` (the first p rows of the document's prefill) is `icl_truncated` (the document's
    first p tokens prefilled as context): a causal model's rows at a position see only the
    tokens before it, so one name serves both."""
    ids = torch.tensor(system_ids(lm.tokenizer, DOCS[0]))
    budget = 40
    cut = first_rows(capture_rows(lm.model, ids), budget)
    truncated = capture_rows(lm.model, ids[:budget])
    for (k1, v1), (k2, v2) in zip(cut, truncated, strict=True):
        assert k1.shape[1] == budget and torch.allclose(k1, k2, atol=1e-5) and torch.allclose(v1, v2, atol=1e-5)


def test_rows_beside_chunks_score_as_those_tokens_prefilled_before_the_chunks(lm):
    """The cartridge-plus-retrieval arm: rows that are the exact KV of some tokens, then the chunks
    retrieval picks for what the rows leave of the budget, score every option as a plain prefill of
    those tokens followed by the chunks; the two together hold at most the budget."""
    from cartridges.evaluation.evaluate import Arm, score_arm
    from cartridges.evaluation.qa import Question
    from stages.evaluate import Inputs

    budget = 120
    inputs = Inputs(lm, [], {"a.md": DOCS[0], "b.md": DOCS[1], "c.md": DOCS[2]}, rag_chunk=16, budget=budget)
    lead = system_ids(lm.tokenizer, "Notes on three places.")
    rows = capture_rows(lm.model, torch.tensor(lead))
    q = Question(1, "When is the quokka festival held?", 0, ("In June", "In May"), "a.md")
    combo = inputs.rag_beside("combo", lambda q: rows)
    context = combo.context(q)
    assert len(lead) + len(context) <= budget
    assert budget - len(lead) - len(context) < 16 + 2  # within one chunk of what the rows leave
    assert context == inputs.rag_context("bm25", q, budget - len(lead))
    scored, _ = score_arm(lm, combo, [q], likelihood_only=True)
    reference, _ = score_arm(lm, Arm("prefill", key=lambda q: "", context=lambda q: lead + context), [q],
                             likelihood_only=True)
    assert scored[0].kv_rows == reference[0].kv_rows
    assert scored[0].gold_nll == pytest.approx(reference[0].gold_nll, abs=1e-4)
    bare, _ = score_arm(lm, Arm("bare", key=lambda q: "", rows=lambda q: []), [q], likelihood_only=True)
    assert abs(bare[0].gold_nll - scored[0].gold_nll) > 1e-3  # the rows and chunks are read at all


def test_eval_on_a_corpus_longer_than_the_window_scores_every_arm_at_equal_rows(tmp_path):
    """Three documents, together longer than the tiny model's 2,048-token window: every arm is
    scored, the ICL contexts say how much they were cut, and the peers (the corpus's first rows,
    knorm, SnapKV, both retrievers) hold the cartridge's rows."""
    import json

    from cartridges.core.cartridge import init_from_corpus
    from cartridges.core.files import save_cartridge
    from cartridges.evaluation.qa import read_questions
    from stages import evaluate
    from storage import Store

    lm = tiny_llama()
    names = ["a.md", "b.md", "c.md"]
    texts = ["The apple code is 1001. " * 40, "The birch code is 2002. " * 40, "The cedar code is 3003. " * 40]
    for name, text in zip(names, texts, strict=True):
        (tmp_path / name).write_text(text)
    assert sum(len(t) for t in texts) > lm.context_length  # byte-level tokens
    qa = tmp_path / "q.jsonl"
    qa.write_text("".join(json.dumps({"doc": n, "question": f"What is the {w} code?", "options": [c, "4004"],
                                      "answer": 0}) + "\n"
                          for n, w, c in zip(names, ("apple", "birch", "cedar"), ("1001", "2002", "3003"),
                                             strict=True)))
    cart = save_cartridge(tmp_path / "c.safetensors", init_from_corpus(lm, "".join(texts), p=128), lm.fingerprint)
    questions, problems = read_questions(qa)
    result = evaluate.run(Store(tmp_path / "s"), lm, str(qa), questions, problems, [str(cart)],
                          [str(tmp_path / n) for n in names], max_new=2, log=lambda _: None, rag_chunk=32)
    arms = result["arms"]
    assert set(arms) == {"bare", "icl", "icl_window", "full_kv", "cartridge", "knorm", "snapkv", "first", "rag",
                         "rag_dense"}
    cart_rows = arms["cartridge"]["kv_rows"]
    for arm in ("knorm", "snapkv", "first"):
        assert arms[arm]["kv_rows"] == cart_rows
    for arm in ("rag", "rag_dense"):
        assert 0 <= cart_rows - arms[arm]["kv_rows"] < 32 + 2
    assert arms["icl_window"]["kv_rows"] > arms["icl"]["kv_rows"]  # the window against one document
    assert any("the corpus cut by" in n for n in result["notes"])  # said, not silent
    for arm in arms.values():
        assert arm["accuracy"] is not None and arm["gold_nll"] is not None
