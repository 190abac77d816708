"""The project's question set: enough questions per document, balanced answers, real regions.

Read straight from the JSON lines (not through the loader), so the file's
invariants are checked independently of what `cartridges.evaluation.qa` accepts; the loader
is then checked to read every line with the same fields.
"""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

import pytest

from cartridges.evaluation.qa import read_questions

EVAL = Path(__file__).resolve().parent.parent / "docs" / "eval"
QUESTIONS = EVAL / "questions.jsonl"
MAX_LENGTH_RATIO = 3.0  # longest over shortest option, in characters


def _lines() -> list[dict]:
    return [json.loads(line) for line in QUESTIONS.read_text(encoding="utf-8").splitlines() if line.strip()]


def _headings(doc: str) -> set[str]:
    text = (EVAL / doc).read_text(encoding="utf-8")
    return {m.group(1).strip() for m in re.finditer(r"^#{1,6}\s+(.+)$", text, flags=re.M)}


def _by_doc() -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = collections.defaultdict(list)
    for obj in _lines():
        groups[obj["doc"]].append(obj)
    return groups


def test_the_set_covers_three_documents_with_36_questions_each():
    groups = _by_doc()
    assert len(groups) >= 3 and sum(map(len, groups.values())) >= 100
    for doc, items in groups.items():
        assert (EVAL / doc).is_file(), doc
        assert len(items) >= 36, (doc, len(items))


@pytest.mark.parametrize("doc", sorted(_by_doc()))
def test_each_document_has_four_options_and_exactly_balanced_answers(doc):
    items = _by_doc()[doc]
    assert all(len(x["options"]) == 4 and len(set(x["options"])) == 4 for x in items)
    counts = collections.Counter(x["answer"] for x in items)
    assert set(counts) == {0, 1, 2, 3} and len(set(counts.values())) == 1, counts
    questions = [x["question"] for x in items]
    assert len(set(questions)) == len(questions), "a question is asked twice"


@pytest.mark.parametrize("doc", sorted(_by_doc()))
def test_each_question_names_a_real_heading_of_its_document(doc):
    headings = _headings(doc)
    unknown = [(x["question"], x.get("region")) for x in _by_doc()[doc] if x.get("region") not in headings]
    assert not unknown, unknown


def test_options_of_a_question_have_similar_lengths():
    for x in _lines():
        lengths = [len(o) for o in x["options"]]
        assert max(lengths) <= MAX_LENGTH_RATIO * min(lengths), (x["question"], x["options"])


def test_the_loader_reads_every_line_with_its_doc_and_region():
    questions, problems = read_questions(QUESTIONS)
    assert problems == []
    raw = _lines()
    assert [(q.doc, q.region, q.answer, list(q.options)) for q in questions] == [
        (x["doc"], x["region"], x["answer"], x["options"]) for x in raw]


def test_a_region_must_be_a_non_empty_string(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [
        {"question": "Q?", "options": ["a", "b"], "answer": 0, "region": "Intro"},
        {"question": "Q?", "options": ["a", "b"], "answer": 0, "region": ""},
        {"question": "Q?", "options": ["a", "b"], "answer": 0, "region": 3},
    ]))
    questions, problems = read_questions(path)
    assert [q.region for q in questions] == ["Intro"]
    assert len(problems) == 2 and all("'region'" in p for p in problems)
