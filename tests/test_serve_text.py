"""Streaming text: whole characters only, and stop strings that span tokens."""

from __future__ import annotations

from server.text import TextStream
from tests.tiny import tiny_tokenizer

TOK = tiny_tokenizer()


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def run(text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], TextStream]:
    stream = TextStream(TOK, stop, skip=(TOK.eos_token_id,))
    deltas = [stream.feed(t) for t in ids(text)]
    deltas.append(stream.flush())
    return deltas, stream


def test_multibyte_characters_are_sent_whole():
    deltas, _ = run("héllo → wörld")
    assert "".join(deltas) == "héllo → wörld"
    assert all("\ufffd" not in d for d in deltas)
    assert len(ids("→")) == 3  # one character, three byte tokens: held until complete


def test_text_ends_before_the_first_stop_string_even_across_tokens():
    deltas, stream = run("one two STOP three", stop=("STOP", "never"))
    assert "".join(deltas) == "one two " and stream.stopped
    assert not any("S" in d for d in deltas)  # the stop string's start was held, never sent


def test_held_text_that_is_not_a_stop_string_is_released():
    deltas, stream = run("a STO b", stop=("STOP",))
    assert "".join(deltas) == "a STO b" and not stream.stopped


def test_end_of_turn_tokens_are_not_text():
    stream = TextStream(TOK, skip=(TOK.eos_token_id,))
    out = [stream.feed(t) for t in [*ids("hi"), TOK.eos_token_id]]
    assert "".join(out) + stream.flush() == "hi"
