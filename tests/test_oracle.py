"""The capacity-ceiling experiment: a cartridge distilled on the eval's own questions."""

from __future__ import annotations

import json

import pytest
import torch

from cartridges.core.cartridge import init_from_corpus
from cartridges.core.chat import system_ids
from cartridges.core.train import mean_loss
from cartridges.evaluation.qa import Question
from experiments.oracle import oracle_examples, run, train_oracle
from tests.tiny import tiny_llama

DOC = "The zebra code is 4417. The lion code is 9021. The otter code is 3350. " * 4
QUESTIONS = [Question(1, "What is the zebra code?", 0, ("4417", "9021", "3350"), "d.md"),
             Question(2, "What is the lion code?", 1, ("4417", "9021", "3350"), "d.md"),
             Question(3, "What is the otter code?", 2, ("4417", "9021", "3350"), "d.md")]


@pytest.fixture(scope="module")
def tiny_lm():
    return tiny_llama()


def test_targets_are_the_in_context_models_top_k_on_each_option(tiny_lm):
    tok = tiny_lm.tokenizer
    context = system_ids(tok, DOC)
    examples = oracle_examples(tiny_lm, context, QUESTIONS, k=5, mass=1.0)
    assert len(examples) == 3 * 3
    replies = [o for q in QUESTIONS for o in q.options]
    for ex, option in zip(examples, replies, strict=True):
        assert tok.decode([ex.ids[p] for p in ex.positions]) == option
        # reference: one plain forward over the document's system turn followed by the student's tokens
        with torch.no_grad():
            logits = tiny_lm.model(input_ids=torch.tensor([context + ex.ids])).logits[0].double()
        logq = torch.log_softmax(logits, dim=-1)
        for pos, ids, lps in zip(ex.positions, ex.topk_ids, ex.topk_logprobs, strict=True):
            row = logq[len(context) + pos - 1]
            ref_lp, ref_ids = row.topk(5)
            assert ids == ref_ids.tolist()
            assert lps == pytest.approx(ref_lp.tolist(), abs=1e-4)
    correct = oracle_examples(tiny_lm, context, QUESTIONS, correct_only=True)
    assert [tok.decode([e.ids[p] for p in e.positions]) for e in correct] == ["4417", "9021", "3350"]


def test_training_on_the_questions_lowers_their_loss(tiny_lm):
    context = system_ids(tiny_lm.tokenizer, DOC)
    examples = oracle_examples(tiny_lm, context, QUESTIONS)
    cart = init_from_corpus(tiny_lm, DOC, p=8)
    before = mean_loss(tiny_lm.model, [cart], examples)
    curve = train_oracle(tiny_lm, cart, examples, epochs=4, lr=2e-2, batch=4, log=lambda _: None)
    # a random tiny model's teacher is nearly flat, so the loss has little room to fall; it must
    # still fall at every epoch
    assert len(curve) == 4 and all(b < a for a, b in zip([before, *curve], curve, strict=False))
    assert curve[-1] == pytest.approx(mean_loss(tiny_lm.model, [cart], examples))


def test_the_experiment_reports_both_closures_on_trained_and_held_out_questions(tiny_lm, tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text(DOC)
    qa = tmp_path / "q.jsonl"
    qa.write_text("".join(json.dumps({"doc": q.doc, "question": q.question, "options": list(q.options),
                                      "answer": q.answer}) + "\n" for q in QUESTIONS * 2))
    result = run(tiny_lm, str(qa), str(doc), p=8, epochs=2, batch=4, split=True, log=lambda _: None)
    assert result["examples"] == 3 * 3 and result["loss_curve"][-1] < result["loss_before"]
    assert result["train"]["questions"] == 3 and result["heldout"]["questions"] == 3
    for part in ("train", "heldout"):
        assert set(result[part]["arms"]) == {"bare", "icl", "init", "oracle"}
        assert result[part]["oracle_gap_closure_nll"]["metric"] == "gold_nll"
        assert result[part]["oracle_gap_closure"]["metric"] == "accuracy"
