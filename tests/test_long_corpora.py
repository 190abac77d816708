"""The long evaluation corpora: longer than the default model's window, questions that only the corpus answers.

Each corpus in `docs/eval/long/` is a folder of documents plus `<name>.jsonl` of
multiple-choice questions. The files are read directly here (no model forward pass;
only the default tokenizer, to count tokens), and then through the same loaders that
`cartridges eval` uses, so a corpus that passes here is one the CLI can score.
"""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

import pytest

from cartridges.evaluation.qa import read_questions
from stages.evaluate import read_docs, select_questions

LONG = Path(__file__).resolve().parent.parent / "docs" / "eval" / "long"
CORPORA = sorted(p.stem for p in LONG.glob("*.jsonl"))
WINDOW = 8192  # SmolLM2-135M-Instruct, the default model
MIN_TOKENS, MAX_TOKENS = 20_000, 80_000  # 2.5 to 10 windows
MIN_DOCS, MAX_DOCS = 4, 20
MIN_QUESTIONS = 60
REGIONS = ("beginning", "middle", "end")  # the third of the document, by characters, holding the evidence
MAX_LENGTH_RATIO = 2.5  # longest option over shortest, in characters
POSITION_SHARE = (0.15, 0.35)  # each answer index's share of a file's answers
STOPWORDS = frozenset(
    "a an the of and or to in on for with by as at from is are was were be been it its this that these those "
    "not no his her he she they them their we our you your".split())


def _lines(corpus: str) -> list[dict]:
    text = (LONG / f"{corpus}.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _docs(corpus: str) -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted((LONG / corpus).iterdir()) if p.is_file()}


def _words(text: str) -> list[str]:
    return re.findall(r"[^\W_]+", text.lower())  # letters and digits: "_Traumerei_" is the word "traumerei"


def _content_words(text: str) -> list[str]:
    return [w for w in _words(text) if w not in STOPWORDS and (len(w) > 1 or w.isdigit())]


def _supported(option: str, document: str) -> bool:
    """Crude evidence check: some content word of the option occurs as a word in the document."""
    vocabulary = set(_words(document))
    return any(w in vocabulary for w in _content_words(option))


def test_there_are_three_corpora_each_with_a_folder_of_documents():
    assert len(CORPORA) >= 3, CORPORA
    for corpus in CORPORA:
        assert (LONG / corpus).is_dir(), f"{corpus}.jsonl has no folder {corpus}/"


@pytest.mark.parametrize("corpus", CORPORA)
def test_corpus_is_2_5_to_10_windows_long_in_4_to_20_documents(corpus, default_lm):
    docs = _docs(corpus)
    assert MIN_DOCS <= len(docs) <= MAX_DOCS, (corpus, len(docs))
    assert all(name.endswith((".md", ".txt")) for name in docs), sorted(docs)
    tokens = {name: len(default_lm.tokenizer(text, add_special_tokens=False)["input_ids"])
              for name, text in docs.items()}
    total = sum(tokens.values())
    assert MIN_TOKENS <= total <= MAX_TOKENS, (corpus, total, tokens)
    assert total > 2 * WINDOW  # the point of these corpora: they do not fit in one context


@pytest.mark.parametrize("corpus", CORPORA)
def test_every_question_parses_with_the_loader_and_names_a_document(corpus):
    lines = _lines(corpus)
    questions, problems = read_questions(LONG / f"{corpus}.jsonl")
    assert problems == []
    assert len(questions) == len(lines) >= MIN_QUESTIONS, (corpus, len(questions))
    docs = _docs(corpus)
    for q in questions:
        assert q.multiple_choice and len(q.options) == 4 and len(set(q.options)) == 4, q
        assert q.doc in docs, f"{corpus}:{q.line}: no document {q.doc!r}"
    texts = [q.question for q in questions]
    assert len(set(texts)) == len(texts), "a question is asked twice"


@pytest.mark.parametrize("corpus", CORPORA)
def test_eval_reads_the_folder_and_keeps_every_question(corpus):
    questions, _ = read_questions(LONG / f"{corpus}.jsonl")
    docs = read_docs([str(LONG / corpus)])
    assert set(docs) == set(_docs(corpus))
    kept, notes = select_questions(questions, docs)
    assert len(kept) == len(questions) and notes == []


@pytest.mark.parametrize("corpus", CORPORA)
def test_every_document_has_questions_in_each_third(corpus):
    lines = _lines(corpus)
    assert {x["region"] for x in lines} <= set(REGIONS)
    seen = collections.Counter((x["doc"], x["region"]) for x in lines)
    for doc in _docs(corpus):
        missing = [r for r in REGIONS if not seen[(doc, r)]]
        assert not missing, f"{corpus}/{doc}: no questions about its {', '.join(missing)}"


@pytest.mark.parametrize("corpus", CORPORA)
def test_answer_positions_are_balanced(corpus):
    lines = _lines(corpus)
    counts = collections.Counter(x["answer"] for x in lines)
    low, high = POSITION_SHARE
    for position in range(4):
        assert low <= counts[position] / len(lines) <= high, (corpus, sorted(counts.items()))


@pytest.mark.parametrize("corpus", CORPORA)
def test_options_are_of_similar_length(corpus):
    for x in _lines(corpus):
        lengths = [len(o) for o in x["options"]]
        assert max(lengths) <= MAX_LENGTH_RATIO * min(lengths), (x["question"], x["options"])


@pytest.mark.parametrize("corpus", CORPORA)
def test_the_correct_option_has_a_word_of_its_document(corpus):
    docs = _docs(corpus)
    unsupported = [(x["doc"], x["options"][x["answer"]]) for x in _lines(corpus)
                   if not _supported(x["options"][x["answer"]], docs[x["doc"]])]
    assert unsupported == []


def test_the_word_check_rejects_an_option_the_document_does_not_mention():
    document = "The wheel filename is {distribution}-{version}.whl; RECORD lists every file."
    assert _supported("The RECORD file", document)
    assert not _supported("A zeppelin over Oslo", document)
    assert not _supported("the and of", document)  # stopwords alone are no evidence


def test_the_readme_describes_every_corpus_with_its_question_count():
    readme = (LONG / "README.md").read_text(encoding="utf-8")
    for corpus in CORPORA:
        assert f"`{corpus}/`" in readme, corpus
        assert f"{len(_lines(corpus))} questions" in readme, corpus
