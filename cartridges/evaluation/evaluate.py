"""Evaluation arms: the same questions answered with different things in front of them.

An arm gives each question either prefix rows (bare: none; a cartridge; the
document's full KV; a compressed KV; a fleet selection), answered on the path a
cartridge is served on, or the document as ordinary context (ICL). Every arm is
scored the same way: option log-likelihood, the correct option's NLL and generated
answers for multiple choice, answer NLL for free form, plus KV rows and time to
first token.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from cartridges.core.batch import Stream
from cartridges.core.chat import end_of_turn_ids, system_ids
from cartridges.core.generate import generate
from cartridges.core.models import LoadedModel, cache_keyword, probe_geometry
from cartridges.core.prefix import Rows, prefix_cache, prefix_length
from cartridges.evaluation.qa import Question
from cartridges.evaluation.scoring import (
    bootstrap_ci,
    choose_option,
    closure_ci,
    gap_closure,
    length_normalized_choice,
    logprobs_behind,
    logprobs_in_context,
    native_context,
    question_text,
    replies,
    reply_ids,
    student_prompt,
)

TTFT_QUESTIONS = 3


@dataclass
class Arm:
    """How one arm sees a question: prefix rows (served path), context ids (ICL path), or both:
    context tokens read behind the rows, as a cartridge beside retrieved chunks would be served.

    `key` groups questions that share the same rows or context, so each is built once.
    """

    name: str
    key: Callable[[Question], str]
    rows: Callable[[Question], Rows] | None = None
    context: Callable[[Question], list[int]] | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class Scored:
    question: Question
    correct: bool | None = None  # option log-likelihood (multiple choice)
    correct_gen: bool | None = None  # generated answer, fuzzy-matched to an option
    hit_limit: bool = False
    nll: float | None = None  # mean per-token NLL of the reference (free form)
    gold_nll: float | None = None  # mean per-token NLL of the correct option (multiple choice)
    kv_rows: int = 0
    reply: str = ""


def _row_bytes(lm: LoadedModel) -> int:
    """Bytes one cache row costs across all layers (keys and values)."""
    per = torch.finfo(lm.dtype).bits // 8
    return sum((hk * dk + hv * dv) * per for hk, dk, hv, dv in probe_geometry(lm.model))


def _generate_in_context(lm: LoadedModel, context_rows: Rows, context: list[int], prompt: list[int],
                         max_new: int, eot: list[int]) -> tuple[list[int], bool]:
    """Greedy reply with the library's own `generate`, continuing the native context cache."""
    ids = torch.tensor([context + prompt], device=lm.device)
    out = lm.model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
        eos_token_id=eot, pad_token_id=eot[0], **{cache_keyword(lm.model): prefix_cache(context_rows, 1)},
    )
    tokens = [int(t) for t in out[0, ids.shape[1]:]]
    stopped = bool(tokens) and tokens[-1] in eot
    return tokens, not stopped and len(tokens) >= max_new


def _seconds(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def score_arm(lm: LoadedModel, arm: Arm, questions: Sequence[Question], max_new: int = 48,
              batch_size: int = 16, likelihood_only: bool = False,
              progress: Callable[[int], None] | None = None) -> tuple[list[Scored], float]:
    """Per-question scores and the median time to first token of this arm.

    `likelihood_only` skips generated answers and the TTFT measurement (NaN), for
    callers that need only option log-likelihoods and NLLs.
    """
    tok = lm.tokenizer
    eot = end_of_turn_ids(tok)
    prompts = [student_prompt(tok, question_text(q)) for q in questions]  # generation: options listed
    plain = [student_prompt(tok, q.question) for q in questions]  # likelihood: the question alone
    scored = [Scored(q) for q in questions]
    groups: dict[str, list[int]] = {}
    for i, q in enumerate(questions):
        groups.setdefault(arm.key(q), []).append(i)
    for idx in groups.values():
        first = questions[idx[0]]
        rows = arm.rows(first) if arm.rows else None
        context = arm.context(first) if arm.context else []
        # context alone: the library's own prefill; behind rows: read on the prefix path
        context_rows = native_context(lm, context) if context and rows is None else None
        prefix = len(context) + (prefix_length(rows) if rows else 0)
        for i in idx:
            q, prompt = questions[i], plain[i]
            conts = [reply_ids(tok, prompt, r) for r in replies(q)]
            if context_rows is not None:
                sums = logprobs_in_context(lm, context_rows, prompt, conts)
            else:
                sums = logprobs_behind(lm, rows, context + prompt, conts)
            s = scored[i]
            s.kv_rows = prefix + len(prompt)
            if q.multiple_choice:
                s.correct = length_normalized_choice(sums, [len(c) for c in conts]) == q.answer
                # per token, like the choice itself: accuracy is the sign of a margin in this measure
                s.gold_nll = -sums[q.answer] / len(conts[q.answer])
            else:
                s.nll = -sums[0] / len(conts[0])
            if progress:
                progress(1)
        mc = [i for i in idx if questions[i].multiple_choice]
        if not mc or likelihood_only:
            continue
        if context_rows is not None:
            outs = [_generate_in_context(lm, context_rows, context, prompts[i], max_new, eot) for i in mc]
        else:
            gens = generate(lm.model, [Stream(context + prompts[i], max_new, stop_ids=tuple(eot)) for i in mc],
                            batch_size=batch_size, prefix_rows=rows)
            outs = [(g.tokens, g.finished == "length") for g in gens]
        for i, (tokens, limit) in zip(mc, outs, strict=True):
            text = tok.decode([t for t in tokens if t not in eot], skip_special_tokens=True).strip()
            # "hit the limit" is judged on the re-tokenized text, as a reader would count it.
            s = scored[i]
            s.reply, s.hit_limit = text, limit and len(tok(text, add_special_tokens=False)["input_ids"]) >= max_new - 1
            s.correct_gen = choose_option(text, questions[i].options) == questions[i].answer
    return scored, float("nan") if likelihood_only else arm_ttft(lm, arm, questions, prompts, eot)


def arm_ttft(lm: LoadedModel, arm: Arm, questions: Sequence[Question], prompts: list[list[int]] | None = None,
             eot: list[int] | None = None) -> float:
    """Median seconds to the first answer token: ICL tokenizes and prefills its context;
    a prefix arm prefills only the question (and any context) behind rows already loaded.

    An arm with context is timed on one question: its prefill dominates and varies little,
    and on a long document each timing costs as much as scoring several questions."""
    eot = eot or end_of_turn_ids(lm.tokenizer)
    prompts = prompts or [student_prompt(lm.tokenizer, question_text(q)) for q in questions]
    times = []
    for i in range(min(1 if arm.context else TTFT_QUESTIONS, len(questions))):
        q = questions[i]
        rows = arm.rows(q) if arm.rows else None

        def run(q=q, i=i, rows=rows):
            ids = (arm.context(q) if arm.context else []) + prompts[i]
            generate(lm.model, [Stream(ids, 1, stop_ids=tuple(eot))], batch_size=1, prefix_rows=rows)
        times.append(_seconds(run))
    return statistics.median(times) if times else float("nan")


def summarize_arm(lm: LoadedModel, name: str, scored: Sequence[Scored], ttft: float, notes: list[str]) -> dict:
    """One arm's figures: accuracy (log-likelihood and generated), gold-option NLL, intervals,
    answer NLL, KV cost, TTFT."""
    mc = [s for s in scored if s.correct is not None]
    ff = [s for s in scored if s.nll is not None]
    out: dict = {"questions": len(scored), "kv_rows": statistics.mean(s.kv_rows for s in scored),
                 "ttft_s": ttft, "notes": notes}
    out["kv_bytes"] = out["kv_rows"] * _row_bytes(lm)
    if mc:
        acc = [float(s.correct) for s in mc]
        gen = [float(bool(s.correct_gen)) for s in mc]
        out.update(accuracy=statistics.mean(acc), accuracy_ci=bootstrap_ci(acc),
                   accuracy_gen=statistics.mean(gen), accuracy_gen_ci=bootstrap_ci(gen),
                   hit_limit=sum(s.hit_limit for s in mc), multiple_choice=len(mc))
        gold = [s.gold_nll for s in mc if s.gold_nll is not None]
        if gold:
            out.update(gold_nll=statistics.mean(gold), gold_nll_ci=bootstrap_ci(gold))
    if ff:
        out.update(answer_nll=statistics.mean(s.nll for s in ff), free_form=len(ff))
    return out


def _higher_is_better(scored: Sequence[Scored], metric: str) -> list[float]:
    """Per-question values of `metric`, signed so that larger is better (NLLs negated)."""
    if metric == "accuracy":
        return [float(s.correct) for s in scored if s.correct is not None]
    attr = {"gold_nll": "gold_nll", "answer_nll": "nll"}[metric]
    return [-getattr(s, attr) for s in scored if getattr(s, attr) is not None]


def closure(scored: dict[str, Sequence[Scored]], candidate: str, metric: str | None = None) -> dict:
    """ICL-gap closure of `candidate` on `metric`, with a 95% interval resampling questions.

    `metric`: "accuracy" (the default for files with multiple choice), "gold_nll" (the
    correct option's NLL) or "answer_nll" (the default for free-form files). On an NLL,
    closure is (bare - candidate) / (bare - icl).
    """
    if metric is None:
        metric = "accuracy" if any(s.correct is not None for s in scored.get("bare", ())) else "answer_nll"
    out: dict = {"value": None, "reason": None, "metric": metric, "ci": None}
    if "bare" not in scored or "icl" not in scored or candidate not in scored:
        return {**out, "reason": "needs bare, icl and " + candidate + " arms"}
    c, b, i = (_higher_is_better(scored[name], metric) for name in (candidate, "bare", "icl"))
    if not c:
        return {**out, "reason": f"no question is scored on {metric}"}
    mc, mb, mi = (statistics.mean(v) for v in (c, b, i))
    if metric == "accuracy":
        value, reason = gap_closure(mc, mb, mi, len(c))
        min_gap = 2 / len(c)
    else:
        value, reason = ((mc - mb) / (mi - mb), None) if mi > mb else (None, f"in-context {metric} is not below bare")
        min_gap = 0.0
    out.update(value=value, reason=reason)
    if value is not None:
        ci, left_out = closure_ci(c, b, i, min_gap)
        out["ci"] = list(ci) if ci else None
        if left_out:
            out["ci_left_out"] = left_out  # resamples whose ICL gap was too small for a ratio
    return out


def document_context(lm: LoadedModel, text: str, reserve: int) -> tuple[list[int], int]:
    """The ICL context ids for a document, cut to leave `reserve` positions, and how many were cut."""
    ids = system_ids(lm.tokenizer, text)
    room = lm.context_length - reserve
    if room < 16:
        raise ValueError(f"context window {lm.context_length} leaves no room for a document")
    return (ids, 0) if len(ids) <= room else (ids[:room], len(ids) - room)


def cached(fn: Callable[[str], object]) -> Callable[[str], object]:
    memo: dict[str, object] = {}

    def get(key: str):
        if key not in memo:
            memo[key] = fn(key)
        return memo[key]
    return get
