"""Where a cartridge sits in a chat, per template family, against renderings written out by hand.

ChatML (SmolLM2's, which injects a default system prompt when none is given) has a
system role; Gemma 3's template has none and folds a system message into the first
user turn. Either way the cartridge replaces exactly the document's tokens, at
training, ask and serve time, and nothing is rendered between it and the user's words.
"""

from __future__ import annotations

import pytest
import torch

from cartridges.core.chat import chat_ids, system_ids
from cartridges.evaluation import ask, scoring
from schemas import SynthConfig
from server.selector import render_prompt
from stages.synthesize import synthesize_group
from tests.tiny import gemma_tokenizer, tiny_gemma3, tiny_llama, tiny_tokenizer

DOC, Q1, A1, Q2 = "zlib wraps DEFLATE.", "What wraps DEFLATE?", "zlib does.", "And gzip?"

FAMILIES = {
    "chatml": (tiny_tokenizer, tiny_llama, {
        "document": f"<|im_start|>system\n{DOC}<|im_end|>\n",
        "question": f"<|im_start|>user\n{Q1}<|im_end|>\n<|im_start|>assistant\n",
        "follow_up": (f"<|im_start|>user\n{Q1}<|im_end|>\n<|im_start|>assistant\n{A1}<|im_end|>\n"
                      f"<|im_start|>user\n{Q2}<|im_end|>\n<|im_start|>assistant\n"),
    }),
    "gemma3": (gemma_tokenizer, tiny_gemma3, {
        "document": f"<bos><start_of_turn>user\n{DOC}\n\n",
        "question": f"{Q1}<end_of_turn>\n<start_of_turn>model\n",
        "follow_up": (f"{Q1}<end_of_turn>\n<start_of_turn>model\n{A1}<end_of_turn>\n"
                      f"<start_of_turn>user\n{Q2}<end_of_turn>\n<start_of_turn>model\n"),
    }),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cartridge_takes_exactly_the_documents_place(family):
    make_tokenizer, _, want = FAMILIES[family]
    tok = make_tokenizer()
    head = system_ids(tok, DOC)
    served = render_prompt(tok, [{"role": "user", "content": Q1}])
    assert tok.decode(head) == want["document"]
    assert tok.decode(served) == want["question"]
    # The document's head plus what follows the cartridge is the real conversation.
    real = chat_ids(tok, [{"role": "system", "content": DOC}, {"role": "user", "content": Q1}],
                    add_generation_prompt=True)
    assert head + served == real
    # ask and scoring put the same tokens behind the cartridge as the server.
    assert ask.student_prompt(tok, Q1) == scoring.student_prompt(tok, Q1) == served
    follow = render_prompt(tok, [{"role": "user", "content": Q1}, {"role": "assistant", "content": A1},
                                 {"role": "user", "content": Q2}])
    assert tok.decode(follow) == want["follow_up"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_synthesized_student_sequence_is_the_served_prompt_plus_the_answer(family):
    """Training sees behind the cartridge what serving will send: no document, no default system prompt."""
    make_tokenizer, make_model, _ = FAMILIES[family]
    lm = make_model(torch.float64)
    tok = lm.tokenizer
    chunks = [{"chunk_id": i, "doc_id": 0, "seed_type": "question", "split": "train", "rng_seed": i, "tokens": 8}
              for i in range(2)]
    rows = synthesize_group(lm, chunks, [DOC, DOC + " Twice."], SynthConfig(max_q=6, max_a=6, filter=False, focus=False))
    assert len(rows) == 2
    for row, ctx in zip(rows, [DOC, DOC + " Twice."], strict=True):
        student, start = row["student_ids"], row["student_answer_start"]
        assert row["teacher_ids"] == system_ids(tok, ctx) + student
        assert student[:start] == render_prompt(tok, [{"role": "user", "content": row["question"]}])
        text = tok.decode(student)
        assert DOC not in text and "You are a helpful assistant" not in text


def test_a_template_that_drops_system_messages_is_refused():
    tok = tiny_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'system' %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ValueError, match="neither as a turn nor ahead of the first user turn"):
        system_ids(tok, DOC)


def test_a_base_model_without_a_template_is_refused_in_one_line():
    from cartridges.core.cartridge import init_from_corpus
    from cartridges.core.errors import ModelError

    lm = tiny_llama()
    lm.tokenizer.chat_template = None
    for attempt in (lambda: system_ids(lm.tokenizer, DOC), lambda: render_prompt(lm.tokenizer, [{"role": "user", "content": Q1}]),
                    lambda: init_from_corpus(lm, DOC * 4, p=8)):
        with pytest.raises(ModelError, match="no chat template") as err:
            attempt()
        assert "\n" not in str(err.value)
