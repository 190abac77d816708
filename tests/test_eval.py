"""Evaluation: question files, option scoring, fuzzy matching, gap closure, the eval stage."""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest
import torch

from cartridges.core.cartridge import init_from_corpus
from cartridges.core.chat import system_ids
from cartridges.core.files import save_cartridge
from cartridges.evaluation.evaluate import Arm, Scored, closure, score_arm, summarize_arm
from cartridges.evaluation.qa import QAError, Question, read_questions
from cartridges.evaluation.scoring import (
    bootstrap_ci,
    choose_option,
    closure_ci,
    gap_closure,
    length_normalized_choice,
    logprobs_behind,
    logprobs_in_context,
    native_context,
    reply_ids,
    student_prompt,
)
from stages import evaluate
from storage import Store
from tests.tiny import tiny_llama


@pytest.fixture(scope="module")
def tiny_lm():
    return tiny_llama()


def test_malformed_lines_are_reported_by_number_and_skipped(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join([
        json.dumps({"question": "Q1?", "options": ["a", "b"], "answer": 1, "doc": "d.md"}),
        "{not json",
        json.dumps({"question": "Q2?", "options": ["a", "b"], "answer": 2}),
        json.dumps({"question": "", "answer": "x"}),
        "",
        json.dumps({"question": "Q3?", "answer": "free text"}),
        json.dumps(["a list"]),
        json.dumps({"question": "Q4?", "options": ["a"], "answer": 0}),
        json.dumps({"question": "Q5?", "options": ["a", "b"], "answer": True}),
    ]))
    questions, problems = read_questions(path)
    assert [(q.line, q.multiple_choice) for q in questions] == [(1, True), (6, False)]
    assert questions[0].doc == "d.md" and questions[1].answer == "free text"
    assert [p.split(":")[1] for p in problems] == ["2", "3", "4", "7", "8", "9"]
    assert "not JSON" in problems[0] and "0..1" in problems[1] and "non-empty" in problems[2]


def test_a_file_without_usable_lines_is_an_error(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("oops\n")
    with pytest.raises(QAError, match=r"no usable question lines .*q.jsonl:1"):
        read_questions(path)
    with pytest.raises(QAError, match="no such question file"):
        read_questions(tmp_path / "missing.jsonl")


def test_fuzzy_matching_reads_letters_and_option_text():
    options = ["Raft uses randomized timeouts", "Paxos", "150-300 ms", "Two-phase commit"]
    assert choose_option("C. 150-300 ms", options) == 2
    assert choose_option("(B) Paxos", options) == 1
    assert choose_option("The answer is 150-300 ms.", options) == 2
    assert choose_option("randomized timeouts are used by raft", options) == 0
    assert choose_option("I do not know what you mean", options) is None
    assert choose_option("", options) is None
    assert choose_option("E. none", options) is None  # a letter with no such option falls back to text


def test_gap_closure_arithmetic_and_its_null_case():
    value, reason = gap_closure(0.6, 0.4, 0.8, n=20)
    assert reason is None and value == pytest.approx(0.5)
    value, reason = gap_closure(0.5, 0.40, 0.45, n=20)  # ICL ahead by one question only
    assert value is None and "1 of 20" in reason
    value, _ = gap_closure(0.9, 0.4, 0.8, n=10)  # above ICL: closure > 1 is reported as is
    assert value == pytest.approx(1.25)


def test_length_normalization_and_bootstrap_interval():
    assert length_normalized_choice([-4.0, -3.0], [4, 1]) == 0  # -1.0/token beats -3.0/token
    lo, hi = bootstrap_ci([1.0] * 6 + [0.0] * 4)
    assert lo < 0.6 < hi and 0 <= lo and hi <= 1
    reference = np.random.default_rng(0).integers(0, 10, size=(2000, 10))
    x = np.array([1.0] * 6 + [0.0] * 4)
    assert (lo, hi) == (np.percentile(x[reference].mean(1), 2.5), np.percentile(x[reference].mean(1), 97.5))
    assert bootstrap_ci([1.0, 1.0]) == (1.0, 1.0)


def _dense_logprob(lm, ids: list[int], start: int) -> float:
    """Reference: one ordinary forward over the whole sequence, summing log p of ids[start:]."""
    with torch.no_grad():
        logits = lm.model(input_ids=torch.tensor([ids])).logits[0].double()
    logq = torch.log_softmax(logits, dim=-1)
    return float(sum(logq[i - 1, ids[i]] for i in range(start, len(ids))))


def test_both_scoring_paths_equal_a_dense_forward(tiny_lm):
    tok = tiny_lm.tokenizer
    document = "The zebra code is 4417. " * 3
    context = system_ids(tok, document)
    prompt = student_prompt(tok, "What is the zebra code?")
    conts = [reply_ids(tok, prompt, r) for r in ("4417", "no idea at all")]
    rows = native_context(tiny_lm, context)
    behind = logprobs_behind(tiny_lm, rows, prompt, conts)
    native = logprobs_in_context(tiny_lm, rows, prompt, conts)
    for cont, a, b in zip(conts, behind, native, strict=True):
        ref = _dense_logprob(tiny_lm, context + prompt + cont, len(context) + len(prompt))
        assert a == pytest.approx(ref, abs=1e-4) and b == pytest.approx(ref, abs=1e-4)
    bare = logprobs_behind(tiny_lm, [], prompt, conts)
    for cont, a in zip(conts, bare, strict=True):
        assert a == pytest.approx(_dense_logprob(tiny_lm, prompt + cont, len(prompt)), abs=1e-4)


def _chat_text(tok, turns: list[tuple[str, str]]) -> list[int]:
    """Reference ids: the ChatML text written out by hand, tokenized in one piece."""
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_gold_nll_equals_a_dense_forward_in_context_behind_rows_and_bare(tiny_lm):
    tok = tiny_lm.tokenizer
    document = "The zebra code is 4417. The lion code is 9021. " * 3
    questions = [Question(1, "What is the zebra code?", 0, ("4417", "9021 or so"), "d.md"),
                 Question(2, "What is the lion code?", 1, ("4417", "9021 or so"), "d.md")]
    context = system_ids(tok, document)
    arms = {"icl": Arm("icl", key=lambda q: "d", context=lambda q: context),
            "rows": Arm("rows", key=lambda q: "d", rows=lambda q: native_context(tiny_lm, context)),
            "bare": Arm("bare", key=lambda q: "", rows=lambda q: [])}
    for name, arm in arms.items():
        scored, ttft = score_arm(tiny_lm, arm, questions, max_new=2)
        expected = []
        for q, s in zip(questions, scored, strict=True):
            head = [("system", document)] if name != "bare" else []
            prompt = _chat_text(tok, [*head, ("user", q.question)]) + tok("<|im_start|>assistant\n")["input_ids"]
            gold = tok(q.options[q.answer], add_special_tokens=False)["input_ids"]
            expected.append(-_dense_logprob(tiny_lm, prompt + gold, len(prompt)) / len(gold))
            assert s.gold_nll == pytest.approx(expected[-1], abs=1e-4), name
        summary = summarize_arm(tiny_lm, name, scored, ttft, [])
        assert summary["gold_nll"] == pytest.approx(statistics.mean(expected), abs=1e-4)
        assert summary["gold_nll_ci"] == bootstrap_ci([s.gold_nll for s in scored])
        quick, no_ttft = score_arm(tiny_lm, arm, questions, likelihood_only=True)
        assert [(s.correct, s.gold_nll) for s in quick] == [(s.correct, s.gold_nll) for s in scored]
        assert all(s.correct_gen is None and s.reply == "" for s in quick) and math.isnan(no_ttft)


def _constructed(bare: list[float], icl: list[float], cart: list[float], metric: str) -> dict[str, list[Scored]]:
    q = Question(1, "?", 0, ("a", "b"))
    field = "correct" if metric == "accuracy" else "gold_nll"
    return {arm: [Scored(q, **{field: (bool(v) if field == "correct" else v)}) for v in values]
            for arm, values in (("bare", bare), ("icl", icl), ("cartridge", cart))}


def test_nll_gap_closure_on_constructed_numbers():
    # every question's cartridge NLL lies halfway between bare and ICL: closure 0.5 in every resample
    bare, icl = [3.0, 4.0, 2.5, 5.0], [1.0, 2.0, 0.5, 1.0]
    half = [(b + i) / 2 for b, i in zip(bare, icl, strict=True)]
    c = closure(_constructed(bare, icl, half, "gold_nll"), "cartridge", "gold_nll")
    assert c["value"] == pytest.approx(0.5) and c["ci"] == pytest.approx([0.5, 0.5]) and c["metric"] == "gold_nll"
    # uneven per-question closure: value from the means, interval from paired resamples of questions
    cart = [2.0, 4.0, 0.5, 3.0]
    c = closure(_constructed(bare, icl, cart, "gold_nll"), "cartridge", "gold_nll")
    assert c["value"] == pytest.approx((14.5 / 4 - 9.5 / 4) / (14.5 / 4 - 4.5 / 4))  # (3.625-2.375)/(3.625-1.125)
    draws = np.random.default_rng(0).integers(0, 4, size=(2000, 4))
    ratios = []
    for d in draws:
        mb, mi, mc = (sum(v[j] for j in d) / 4 for v in (bare, icl, cart))
        if mb - mi > 0:
            ratios.append((mb - mc) / (mb - mi))
    assert c["ci"] == pytest.approx([np.percentile(ratios, 2.5), np.percentile(ratios, 97.5)])
    assert c["ci"][0] < c["value"] < c["ci"][1]
    # ICL no better than bare: no closure and no interval
    c = closure(_constructed(bare, bare, cart, "gold_nll"), "cartridge", "gold_nll")
    assert c["value"] is None and c["ci"] is None and "not below bare" in c["reason"]


def test_accuracy_closure_interval_leaves_out_resamples_without_an_icl_margin():
    bare = [0, 0, 0, 0, 1, 0, 0, 0]
    icl = [1, 1, 1, 0, 1, 0, 0, 0]
    cart = [1, 0, 1, 0, 0, 0, 1, 0]
    c = closure(_constructed(bare, icl, cart, "accuracy"), "cartridge")
    assert c["metric"] == "accuracy" and c["value"] == pytest.approx((3 / 8 - 1 / 8) / (4 / 8 - 1 / 8))
    draws = np.random.default_rng(0).integers(0, 8, size=(2000, 8))
    kept = []
    for d in draws:
        mb, mi, mc = (sum(v[j] for j in d) / 8 for v in (bare, icl, cart))
        if (mi - mb) * 8 >= 2 - 1e-9:  # ICL ahead by at least two questions, as gap_closure requires
            kept.append((mc - mb) / (mi - mb))
    assert c["ci"] == pytest.approx([np.percentile(kept, 2.5), np.percentile(kept, 97.5)])
    assert c["ci_left_out"] == 2000 - len(kept) > 0
    with pytest.raises(ValueError, match="equal non-empty"):
        closure_ci([1.0], [1.0, 0.0], [1.0], 0.0)


def _planted(tiny_lm):
    """Two options of equal length; the planted rows make option 0 far likelier."""
    tok = tiny_lm.tokenizer
    question = Question(1, "Which?", 0, ("xq", "zv"), "doc.md")
    prompt = student_prompt(tok, "Which?")
    reply = reply_ids(tok, prompt, "xq")
    # A prefix that repeats the whole exchange many times: a copying model continues it.
    context = (prompt + reply) * 6
    return question, native_context(tiny_lm, context)


def test_option_scoring_follows_the_context(tiny_lm):
    question, rows = _planted(tiny_lm)
    wrong = Question(1, "Which?", 1, question.options, "doc.md")
    with_rows = Arm("rows", key=lambda q: "", rows=lambda q: rows)
    (right,), _ = score_arm(tiny_lm, with_rows, [question], max_new=4)
    (flipped,), _ = score_arm(tiny_lm, with_rows, [wrong], max_new=4)
    assert right.correct is True and flipped.correct is False


def test_eval_stage_writes_table_report_and_chart_and_skips_when_unchanged(tiny_lm, tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("The zebra code is 4417. The lion code is 9021. " * 8)
    qa = tmp_path / "q.jsonl"
    qa.write_text("\n".join(json.dumps(x) for x in [
        {"doc": "doc.md", "question": "What is the zebra code?", "options": ["4417", "9021"], "answer": 0},
        {"doc": "doc.md", "question": "What is the lion code?", "options": ["4417", "9021"], "answer": 1},
        {"doc": "other.md", "question": "Unrelated?", "options": ["a", "b"], "answer": 0},
        {"doc": "doc.md", "question": "What is the zebra code?", "answer": "4417"},
    ]) + "\nbroken\n")
    cart = init_from_corpus(tiny_lm, doc.read_text(), p=96)  # room for a retrieved chunk after the template
    path = save_cartridge(tmp_path / "c.safetensors", cart, tiny_lm.fingerprint)
    questions, problems = read_questions(qa)
    store = Store(tmp_path / "store")
    result = evaluate.run(store, tiny_lm, str(qa), questions, problems, [str(path)], [str(doc)],
                          max_new=4, log=lambda _: None, rag_chunk=24)
    assert set(result["arms"]) == {"bare", "icl", "full_kv", "cartridge", "knorm", "snapkv", "first", "rag",
                                   "rag_dense"}
    assert result["questions"] == 3
    assert any("other.md" in n for n in result["notes"]) and any(":5: not JSON" in n for n in result["notes"])
    icl, full = result["arms"]["icl"], result["arms"]["full_kv"]
    assert icl["accuracy"] == full["accuracy"]
    assert icl["answer_nll"] == pytest.approx(full["answer_nll"], abs=1e-4)
    assert result["arms"]["cartridge"]["kv_rows"] < icl["kv_rows"]
    for arm in ("knorm", "snapkv", "first"):
        assert result["arms"][arm]["kv_rows"] == result["arms"]["cartridge"]["kv_rows"]
    for arm in ("rag", "rag_dense"):  # at or below the cartridge's rows, and within one chunk of them
        short = result["arms"]["cartridge"]["kv_rows"] - result["arms"][arm]["kv_rows"]
        assert 0 <= short < 24 + 2
    assert "metric" in result["icl_gap_closure"]
    assert icl["gold_nll"] == pytest.approx(full["gold_nll"], abs=1e-4)
    for arm in result["arms"].values():
        assert arm["gold_nll_ci"][0] <= arm["gold_nll"] <= arm["gold_nll_ci"][1]
    nll = result["icl_gap_closure_nll"]
    assert nll["metric"] == "gold_nll" and nll["arm"] == "cartridge"
    bare_nll, cart_nll = result["arms"]["bare"]["gold_nll"], result["arms"]["cartridge"]["gold_nll"]
    if icl["gold_nll"] < bare_nll:
        assert nll["value"] == pytest.approx((bare_nll - cart_nll) / (bare_nll - icl["gold_nll"]))
    else:
        assert nll["value"] is None and "not below bare" in nll["reason"]
    report = next((tmp_path / "store").rglob("report.md")).read_text()
    assert "| icl |" in report and "gold NLL (95% CI)" in report and "ICL-gap closure (gold_nll)" in report
    assert next((tmp_path / "store").rglob("chart.png")).read_bytes()[:4] == b"\x89PNG"
    answers = [json.loads(x) for x in next((tmp_path / "store").rglob("answers.jsonl")).read_text().splitlines()]
    assert len(answers) == 9 * 3 and {a["arm"] for a in answers} == set(result["arms"])
    assert {a["doc"] for a in answers} == {"doc.md"} and {a["region"] for a in answers} == {None}
    icl_correct = [a["correct"] for a in answers if a["arm"] == "icl" and a["correct"] is not None]
    assert sum(icl_correct) / len(icl_correct) == icl["accuracy"]
    icl_gold = [a["gold_nll"] for a in answers if a["arm"] == "icl" and a["gold_nll"] is not None]
    assert statistics.mean(icl_gold) == pytest.approx(icl["gold_nll"])
    from storage.sql import query
    cols, rows = query(tmp_path / "store", "SELECT arm, value FROM evals WHERE metric = 'accuracy' ORDER BY arm")
    assert dict(rows)["icl"] == icl["accuracy"]
    cols, rows = query(tmp_path / "store", "SELECT arm, value FROM evals WHERE metric = 'gold_nll' ORDER BY arm")
    assert dict(rows)["icl"] == pytest.approx(icl["gold_nll"])
    again = evaluate.run(store, tiny_lm, str(qa), questions, problems, [str(path)], [str(doc)],
                         max_new=4, log=lambda _: None, rag_chunk=24)
    assert again["skipped"] and again["arms"]["icl"]["accuracy"] == icl["accuracy"]
    assert not math.isnan(again["arms"]["bare"]["ttft_s"])
    # Another cartridge of the same size: only its own arm is scored again, the rest are reused
    # (equal to scoring them afresh in a new store).
    other = save_cartridge(tmp_path / "d.safetensors", init_from_corpus(tiny_lm, "other text " * 20, p=96),
                           tiny_lm.fingerprint)
    third = evaluate.run(store, tiny_lm, str(qa), questions, problems, [str(other)], [str(doc)],
                         max_new=4, log=lambda _: None, rag_chunk=24)
    fresh = evaluate.run(Store(tmp_path / "fresh"), tiny_lm, str(qa), questions, problems, [str(other)],
                         [str(doc)], max_new=4, log=lambda _: None, rag_chunk=24)
    assert not third["skipped"]
    assert any(n.startswith("arms reused") and "cartridge" not in n and "icl" in n for n in third["notes"])
    for arm in result["arms"]:
        for metric in ("accuracy", "accuracy_gen", "answer_nll", "gold_nll", "kv_rows"):
            assert third["arms"][arm].get(metric) == fresh["arms"][arm].get(metric), (arm, metric)


def test_fleet_eval_has_retrieval_and_oracle_arms(tiny_lm, tmp_path):
    from jobs.fleet import run_fleet
    from schemas.presets import fleet_preset
    from tests.test_fleet_run import write_docs

    docs = write_docs(tmp_path / "docs")
    run_fleet(Store(tmp_path / "s"), tiny_lm, [docs], tmp_path / "f", fleet_preset("smoke"), log=lambda _: None)
    qa = tmp_path / "q.jsonl"
    qa.write_text("\n".join(json.dumps(x) for x in [
        {"doc": "d0.md", "question": "Where do apples grow?", "options": ["orchards", "orbit"], "answer": 0},
        {"doc": "d1.md", "question": "Where do rockets fly?", "options": ["orchards", "orbit"], "answer": 1},
        {"doc": "d2.md", "question": "Where do rivers run?", "options": ["to the sea", "to orbit"], "answer": 0},
    ]) + "\n")
    questions, problems = read_questions(qa)
    corpus = [str(p) for p in sorted(docs.iterdir())]
    result = evaluate.run(Store(tmp_path / "e"), tiny_lm, str(qa), questions, problems, [], corpus,
                          max_new=4, log=lambda _: None, fleet_dir=str(tmp_path / "f"))
    assert {"bare", "icl", "full_kv", "fleet_retrieval", "fleet_oracle"} <= set(result["arms"])
    from cartridges.fleet import Fleet

    fleet = Fleet.open(tmp_path / "f", tiny_lm)
    picks = [fleet.select(q.question) for q in questions]
    expected_top1 = sum(q.doc == p[0] for q, p in zip(questions, picks, strict=True)) / 3
    assert result["arms"]["fleet_retrieval"]["retrieval_top1"] == pytest.approx(expected_top1)
    one = fleet.cartridge("d0.md").p
    assert result["arms"]["fleet_oracle"]["kv_rows"] == pytest.approx(
        one + statistics.mean(len(student_prompt(tiny_lm.tokenizer, q.question)) for q in questions))
    assert "oracle_gap_closure" in result and result["icl_gap_closure"]["metric"] == "accuracy"


def test_skipped_arms_are_not_scored_and_an_unknown_arm_is_an_error(tiny_lm, tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("The zebra code is 4417. The lion code is 9021. " * 8)
    qa = tmp_path / "q.jsonl"
    qa.write_text(json.dumps({"doc": "doc.md", "question": "What is the zebra code?", "options": ["4417", "9021"],
                              "answer": 0}) + "\n")
    path = save_cartridge(tmp_path / "c.safetensors", init_from_corpus(tiny_lm, doc.read_text(), p=96),
                          tiny_lm.fingerprint)
    questions, problems = read_questions(qa)
    result = evaluate.run(Store(tmp_path / "s"), tiny_lm, str(qa), questions, problems, [str(path)], [str(doc)],
                          max_new=2, log=lambda _: None, peers=False, skip=("full_kv", "rag_dense"))
    assert set(result["arms"]) == {"bare", "icl", "cartridge", "rag"}
    with pytest.raises(ValueError, match="no arm named fulkv"):
        evaluate.run(Store(tmp_path / "s"), tiny_lm, str(qa), questions, problems, [str(path)], [str(doc)],
                     skip=("fulkv",))
