"""Fact coverage: sentence splitting, content words, and when a conversation grounds a sentence."""

from __future__ import annotations

from cartridges.selfstudy.facts import content_words, grounded, grounding_counts, needed, sentences
from stages.facts import fact_coverage, sentence_rows

DOC = """# Raft elections

1. A term starts. It has one leader.

A follower becomes a candidate after an election timeout of 150 to 300 milliseconds.
The candidate votes for itself and asks the others for votes.

- **Leader**: handles every client request and
  replicates log entries.
- Logs never shrink.

| term | leader |
|---|---|
"""


def test_sentences_follow_markdown_blocks_and_sentence_ends():
    assert sentences(DOC) == [  # the heading is a title, not a fact
        "1. A term starts.",
        "It has one leader.",
        "A follower becomes a candidate after an election timeout of 150 to 300 milliseconds.",
        "The candidate votes for itself and asks the others for votes.",
        "- **Leader**: handles every client request and replicates log entries.",
        "- Logs never shrink.",
        "| term | leader |",  # the separator row has no content words and is not listed
    ]


def test_content_words_keep_numbers_and_drop_stop_words():
    assert content_words("The leader was elected in term 2, after 300 ms.") == {
        "leader", "elected", "term", "2", "300", "ms"}


def test_a_sentence_needs_three_shared_words_or_half_of_its_own():
    assert [needed(n) for n in (1, 2, 3, 4, 6, 7, 12)] == [1, 2, 3, 3, 3, 4, 6]


def test_a_conversation_about_the_sentence_grounds_it_and_one_about_other_things_does_not():
    timeout = "A follower becomes a candidate after an election timeout of 150 to 300 milliseconds."
    words = content_words(timeout)
    assert words == {"follower", "becomes", "candidate", "election", "timeout", "150", "300", "milliseconds"}
    about = content_words("Question: how long is the election timeout?\n"
                          "It is random, between 150 and 300 milliseconds.")
    assert len(words & about) == 5 >= needed(8) == 4 and grounded(words, about)
    near = content_words("Question: what starts an election?\nA timeout.")
    assert len(words & near) == 2 and not grounded(words, near)


def test_grounding_counts_every_conversation_per_sentence():
    convs = ["Who do candidates ask for votes? The candidate asks the others for votes and votes for itself.",
             "Do logs shrink? No, logs never shrink.",
             "Do logs shrink? Never."]
    counts = {s: n for s, _, n in grounding_counts(DOC, convs)}
    assert counts["The candidate votes for itself and asks the others for votes."] == 1
    assert counts["- Logs never shrink."] == 2  # all of its three content words: logs, never, shrink
    assert counts["It has one leader."] == 0


def test_sentence_rows_count_only_training_conversations_of_the_same_document():
    docs = [{"doc_id": 0, "text": "Logs never shrink. Terms act as a logical clock."},
            {"doc_id": 1, "text": "Logs never shrink."}]

    def conv(doc_id, split="train", a_ok=True):
        return {"doc_id": doc_id, "split": split, "question": "Do logs shrink?", "answer": "Logs never shrink.",
                "a_ok": a_ok, "b_ok": True, "teacher_ids": [1, 2, 3], "answer_start": 2}

    convs = [conv(0), conv(0, split="heldout"), conv(0, a_ok=False), conv(1, split="heldout")]
    rows = sentence_rows(docs, convs)
    assert [(r["doc_id"], r["sentence"], r["conversations"]) for r in rows] == [(0, 0, 1), (0, 1, 0), (1, 0, 0)]
    assert rows[0]["text"] == "Logs never shrink." and rows[1]["words"] == 4
    assert fact_coverage(rows) == 1 / 3
    # With the filter off, a conversation bot A's check rejected still trains, so it counts.
    assert [r["conversations"] for r in sentence_rows(docs, convs, filtered=False)] == [2, 0, 0]


def test_focus_sentences_skip_cut_ends_and_rotate_over_whole_sentences():
    from cartridges.selfstudy.facts import focus_sentence

    text = "ing cut at the start. One whole fact here. A second whole fact. Third whole fact there. Cut at the e"
    whole = ["One whole fact here.", "A second whole fact.", "Third whole fact there."]
    assert [focus_sentence(text, t) for t in range(5, 11)] == [whole[t % 3] for t in range(5, 11)]
    assert focus_sentence("Only one sentence here.", 4) == "Only one sentence here."
    assert focus_sentence("--- ###", 0) is None
