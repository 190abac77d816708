"""Synthesis helpers: loop cutting and question stop tokens."""

from __future__ import annotations

from stages.synthesize import loop_start, question_stop_ids
from tests.tiny import tiny_tokenizer


def test_loop_start_finds_where_a_repeated_span_recurs():
    head = list(range(100, 120))
    cycle = [1, 2, 3, 4, 5, 6, 7]
    tokens = head + cycle * 5
    cut = loop_start(tokens, span=10)
    assert cut == len(head) + len(cycle)  # the second cycle starts the first recurring window
    assert tokens[:cut] == head + cycle


def test_loop_start_leaves_answers_without_loops_alone():
    assert loop_start(list(range(200)), span=10) is None
    assert loop_start([1, 2, 3] * 3, span=10) is None  # shorter than a window


def test_question_stop_ids_are_exactly_tokens_containing_a_question_mark():
    tok = tiny_tokenizer()
    ids = question_stop_ids(tok)
    assert ids == tuple(sorted(i for t, i in tok.get_vocab().items() if "?" in tok.convert_tokens_to_string([t])))
    assert tok.convert_tokens_to_ids("?") in ids and len(ids) >= 1
