"""Scoring answers: option log-likelihood, generated-answer matching, answer NLL, intervals.

Two model paths score the same prompts. The *prefix* path runs the question behind
cache rows through `forward_behind` (the path a cartridge is served on). The
*in-context* path gives the document to the model the ordinary way: a native
prefill of the context, then the question continuing from that cache with the
library's own positions and masks. A full-KV cartridge must score like the
in-context path; that is the control that the prefix path loses nothing.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence

import numpy as np
import torch

from cartridges.core.chat import chat_ids, end_of_turn_ids, without_system
from cartridges.core.models import LoadedModel, backbone, cache_keyword, project
from cartridges.core.prefix import Rows, capture_rows, forward_behind, prefix_cache
from cartridges.evaluation.qa import Question

LETTERS = "ABCDEFGHIJ"
_LETTER = re.compile(r"^\s*\(?([A-J])\s*[\).:\]]?(\s|$)")


def question_text(q: Question) -> str:
    """The user turn: the question, then its lettered options (multiple choice)."""
    if not q.multiple_choice:
        return q.question
    options = "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(q.options))
    return f"{q.question}\n{options}\nAnswer with the letter and text of the correct option."


def replies(q: Question) -> list[str]:
    """Assistant replies whose likelihood is compared: each option's text, or the reference.

    Scored after the bare question (no option list): with the options listed and
    lettered, a small model's letter preference swamps what the context adds (on
    raft.md, in-context 33% against bare 29%; as plain replies, 58% against 33%).
    """
    if q.multiple_choice:
        return list(q.options)
    return [str(q.answer)]


def student_prompt(tokenizer, text: str) -> list[int]:
    """A user turn as a cartridge sees it: no system turn, none injected by the template."""
    return without_system(tokenizer, [{"role": "system", "content": "-"}, {"role": "user", "content": text}],
                          add_generation_prompt=True)


def reply_ids(tokenizer, prompt: list[int], reply: str) -> list[int]:
    """Token ids of `reply` as the assistant turn that follows `prompt` (closing marker excluded)."""
    full = chat_ids(tokenizer, [{"role": "system", "content": "-"}, {"role": "user", "content": "-"},
                                {"role": "assistant", "content": reply}])
    head = chat_ids(tokenizer, [{"role": "system", "content": "-"}, {"role": "user", "content": "-"}],
                    add_generation_prompt=True)
    if full[: len(head)] != head:
        raise ValueError("the chat template does not render the assistant turn after the prompt")
    body = full[len(head):]
    eot = set(end_of_turn_ids(tokenizer))
    while body and (body[-1] in eot or not tokenizer.decode([body[-1]]).strip()):
        body = body[:-1]
    return body or full[len(head):][:1]


def _batch(prompt: list[int], continuations: Sequence[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = len(prompt) + max(len(c) for c in continuations)
    ids = torch.zeros(len(continuations), width, dtype=torch.long)
    mask = torch.zeros(len(continuations), width, dtype=torch.long)
    for r, cont in enumerate(continuations):
        seq = prompt + cont
        ids[r, : len(seq)] = torch.tensor(seq)
        mask[r, : len(seq)] = 1
    return ids, mask


def _sum_logprobs(model, hidden: torch.Tensor, prompt_len: int, continuations: Sequence[list[int]]) -> list[float]:
    out = []
    for r, cont in enumerate(continuations):
        rows = hidden[r, prompt_len - 1: prompt_len - 1 + len(cont)]
        logq = torch.log_softmax(project(model, rows).float(), dim=-1)
        out.append(float(logq.gather(1, torch.tensor(cont, device=logq.device)[:, None]).sum()))
    return out


@torch.no_grad()
def logprobs_behind(lm: LoadedModel, rows: Rows | None, prompt: list[int],
                    continuations: Sequence[list[int]]) -> list[float]:
    """Summed log-probability of each continuation after `prompt`, behind prefix rows."""
    ids, mask = _batch(prompt, continuations)
    hidden = forward_behind(lm.model, list(rows or []), ids.to(lm.device), mask.to(lm.device))
    return _sum_logprobs(lm.model, hidden, len(prompt), continuations)


@torch.no_grad()
def native_context(lm: LoadedModel, context: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The context's cache from an ordinary prefill (what in-context questions continue from)."""
    return capture_rows(lm.model, torch.tensor(context, device=lm.device))


@torch.no_grad()
def logprobs_in_context(lm: LoadedModel, context_cache: Rows, prompt: list[int],
                        continuations: Sequence[list[int]]) -> list[float]:
    """Like `logprobs_behind`, but continuing a native prefill with the library's own
    positions and causal mask (no cartridge code between the context and the question)."""
    ids, mask = _batch(prompt, continuations)
    n = len(continuations)
    past = int(context_cache[0][0].shape[1])
    cache = prefix_cache(context_cache, n)
    full_mask = torch.cat([torch.ones(n, past, dtype=torch.long), mask], dim=1)
    target = backbone(lm.model)
    out = target(input_ids=ids.to(lm.device), attention_mask=full_mask.to(lm.device), use_cache=True,
                 **{cache_keyword(target): cache})
    return _sum_logprobs(lm.model, out.last_hidden_state, len(prompt), continuations)



def choose_option(reply: str, options: Sequence[str], min_ratio: float = 0.5) -> int | None:
    """The option a generated reply picks: its leading letter, else the closest option text."""
    m = _LETTER.match(reply)
    if m and LETTERS.index(m.group(1)) < len(options):
        return LETTERS.index(m.group(1))
    text = reply.strip().lower()
    if not text:
        return None
    best, best_ratio = None, 0.0
    for i, option in enumerate(options):
        o = option.lower()
        ratio = 1.0 if o in text else difflib.SequenceMatcher(None, text[: 3 * len(o)], o).ratio()
        if ratio > best_ratio:
            best, best_ratio = i, ratio
    return best if best_ratio >= min_ratio else None


def length_normalized_choice(sums: Sequence[float], lengths: Sequence[int]) -> int:
    """The option with the highest mean log-probability per token."""
    return int(np.argmax([s / max(n, 1) for s, n in zip(sums, lengths, strict=True)]))


def bootstrap_ci(values: Sequence[float], samples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the mean, resampling questions."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(samples, x.size))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def gap_closure(cartridge: float, bare: float, icl: float, n: int,
                min_questions: int = 2) -> tuple[float | None, str | None]:
    """(metric_cartridge - metric_bare) / (metric_ICL - metric_bare), or None and why.

    Undefined unless ICL beats bare by at least `min_questions` questions: below that
    the denominator is noise and the ratio can take any value.
    """
    margin = (icl - bare) * n
    if margin < min_questions - 1e-9:
        return None, (f"in-context beats bare by {margin:.0f} of {n} questions "
                      f"(needs at least {min_questions})")
    return (cartridge - bare) / (icl - bare), None


def resampled_closures(cartridge: Sequence[float], bare: Sequence[float], icl: Sequence[float],
                       draw: np.ndarray, min_gap: float = 0.0) -> np.ndarray:
    """The gap closure on each row of `draw` (indices into the per-question lists), NaN where
    the ICL mean does not beat bare by more than 0 and at least `min_gap`, as `gap_closure`
    refuses one. Callers share one draw to keep arms, or several points, paired on the same
    questions.

    Per-question values are higher-is-better and aligned across the three arms.
    """
    c, b, i = (np.asarray(v, dtype=float) for v in (cartridge, bare, icl))
    if not c.size == b.size == i.size or c.size == 0:
        raise ValueError(f"closure needs equal non-empty per-question lists, got {c.size}, {b.size}, {i.size}")
    mc, mb, mi = c[draw].mean(axis=1), b[draw].mean(axis=1), i[draw].mean(axis=1)
    gap = mi - mb
    ok = (gap > 0) & (gap >= min_gap - 1e-9)
    return np.where(ok, (mc - mb) / np.where(ok, gap, 1.0), np.nan)


def closure_ci(cartridge: Sequence[float], bare: Sequence[float], icl: Sequence[float], min_gap: float,
               samples: int = 2000, seed: int = 0) -> tuple[tuple[float, float] | None, int]:
    """95% percentile interval of the gap closure, resampling questions, and how many
    resamples had no defined closure.

    Each resample draws the same questions for all three arms, so the arms stay paired
    (their differences, not their separate spreads, set the width).
    """
    n = len(cartridge)
    draw = np.random.default_rng(seed).integers(0, max(n, 1), size=(samples, n))
    ratio = resampled_closures(cartridge, bare, icl, draw, min_gap)
    ratio = ratio[~np.isnan(ratio)]
    if not ratio.size:
        return None, samples
    return (float(np.percentile(ratio, 2.5)), float(np.percentile(ratio, 97.5))), int(samples - ratio.size)
