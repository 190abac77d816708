"""Seed prompts for bot A and the degenerate-message checks."""

from __future__ import annotations

import pytest

from cartridges.selfstudy.seeds import (
    SEEDS,
    Seed,
    bot_a_prompt,
    clean_question,
    score_answer,
    score_message,
    seed,
)
from schemas import FACT_SEED_TYPES, KNOWN_SEED_TYPES, SEED_TYPES
from tests.tiny import tiny_tokenizer

CHUNK = "Deflate uses a sliding window of 32768 bytes and Huffman codes for literals."


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_all_types_present_and_well_formed():
    assert tuple(SEEDS) == KNOWN_SEED_TYPES == SEED_TYPES + FACT_SEED_TYPES
    assert len(SEED_TYPES) == 7 and len(FACT_SEED_TYPES) == 5
    for name, s in SEEDS.items():
        assert isinstance(s, Seed) and s.type == name
        assert 3 <= len(s.instruction.split()) <= 30
        assert s.assistant_prefix.endswith(":") and s.assistant_prefix == s.assistant_prefix.strip()
    assert "JSON" in SEEDS["structuring"].instruction
    assert "summary" in SEEDS["summarization"].instruction
    assert "why or how" in SEEDS["mechanism"].instruction
    assert "exact" in SEEDS["verbatim"].instruction
    assert all(s.stop_at_question for s in SEEDS.values())
    for name, words in (("fact_number", "number"), ("fact_name", "name"), ("fact_condition", "condition"),
                        ("fact_cause", "why"), ("fact_contrast", "comparing")):
        assert words in SEEDS[name].instruction


def test_unknown_seed_type_names_the_choices():
    with pytest.raises(ValueError, match="unknown seed type 'poem'.*structuring"):
        seed("poem")


@pytest.mark.parametrize("seed_type", KNOWN_SEED_TYPES)
def test_bot_a_prompt_inlines_chunk_once_and_opens_the_turn(tok, seed_type):
    ids = bot_a_prompt(tok, CHUNK, seed_type)
    s = SEEDS[seed_type]
    prefix = tok(s.assistant_prefix, add_special_tokens=False)["input_ids"]
    assert ids[-len(prefix):] == prefix
    text = tok.decode(ids)
    assert text.count(CHUNK) == 1
    assert f"<|im_start|>user\n{CHUNK}\n\n{s.instruction}<|im_end|>" in text
    assert text.endswith(f"<|im_start|>assistant\n{s.assistant_prefix}")
    # The chunk sits in the user turn, never in a system turn.
    system = text.split("<|im_start|>user", 1)[0]
    assert CHUNK not in system


def test_clean_question_cuts_at_question_mark():
    raw = " What window size does Deflate use? It uses 32 KB. Another?"
    assert clean_question(raw, "question") == "What window size does Deflate use?"
    assert clean_question("Question: Question: Why is it fast? Because", "mechanism") == (
        "Why is it fast?")
    assert clean_question(' "Which number is quoted?" said', "verbatim") == "Which number is quoted?"
    # With the stop lever off the message runs on to the end of its first line.
    assert clean_question(raw, "question", stop_at_question=False) == raw.strip()


def test_clean_question_keeps_requests_to_their_first_line():
    raw = " Summarize the part about Huffman codes.\nSure! Here is a summary: ..."
    assert clean_question(raw, "summarization") == "Summarize the part about Huffman codes."
    raw = "Question: Can you list the window size as JSON? Give it a field size."
    assert clean_question(raw, "structuring") == "Can you list the window size as JSON?"


@pytest.mark.parametrize("text, reason", [
    ("", "empty"),
    ("   \n ", "empty"),
    ("Why Deflate?", "too_short"),
    ("What is the the the the the window?", "repetitive"),
    ("What is the size what is the size what is the size?", "repetitive"),
    ("Write one specific question that this text answers.", "echo"),
    ("Deflate uses a sliding window of 32768 bytes.", "not_request"),
    ("Sure, here is a good one for you.", "not_request"),
])
def test_score_message_flags_degenerate(text, reason):
    assert score_message(text, SEEDS["question"].instruction) == (False, reason)


@pytest.mark.parametrize("text, seed_type", [
    ("What is the size of the sliding window that Deflate uses?", "question"),
    ("Why does Deflate use Huffman codes for literals?", "mechanism"),
    ("Summarize how Deflate encodes literals and lengths.", "summarization"),
    ("Please list the window size and code types as a JSON object with fields size and codes.",
     "structuring"),
    ("Write a short poem about the 32768-byte window.", "creative"),
    ("I'd like help choosing a window size for my compressor.", "use_case"),
])
def test_score_message_accepts_good_messages(text, seed_type):
    assert score_message(text, SEEDS[seed_type].instruction) == (True, "")


def test_score_answer():
    q = "What is the size of the sliding window in Deflate?"
    good = "The sliding window in Deflate holds 32768 bytes, that is 32 KB of history."
    assert score_answer(good, q) == (True, "")
    assert score_answer("32 KB.", q) == (True, "")
    assert score_answer("  ", q) == (False, "empty")
    loop = "The window is 32 KB. " + "It is the window of the data. " * 4
    assert score_answer(loop, q) == (False, "repetitive")
    assert score_answer("the " * 20 + "end", q) == (False, "repetitive")
    assert score_answer(q, q) == (False, "copy")
    assert score_answer(q + " Good question.", q) == (False, "copy")
    assert score_answer("The size of the sliding window in Deflate", q) == (False, "copy")
    # Reusing the question's words while adding the fact is an answer, not a copy.
    assert score_answer("The size of the sliding window in Deflate is 32 KB.", q) == (True, "")


def test_a_focus_sentence_is_quoted_before_the_instruction(tok):
    from cartridges.selfstudy.seeds import FOCUS_LEAD

    focus = "Huffman codes for literals."
    text = tok.decode(bot_a_prompt(tok, CHUNK, "question", focus))
    assert f"<|im_start|>user\n{CHUNK}\n\n{FOCUS_LEAD} {focus}\n{SEEDS['question'].instruction}<|im_end|>" in text
    assert tok.decode(bot_a_prompt(tok, CHUNK, "question", None)) == tok.decode(bot_a_prompt(tok, CHUNK, "question"))
