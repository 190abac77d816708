"""Answering one question three ways: behind cartridge(s), bare, and with the corpus in context."""

from __future__ import annotations

import time

from cartridges.core.batch import Stream
from cartridges.core.cartridge import compose_rows
from cartridges.core.chat import end_of_turn_ids
from cartridges.core.corpus import corpus_text
from cartridges.core.files import check_fits, load_cartridge
from cartridges.core.generate import LOOP_SPAN, generate, loop_start
from cartridges.core.models import LoadedModel, load_model
from cartridges.evaluation.evaluate import document_context
from cartridges.evaluation.scoring import student_prompt


def answer(lm: LoadedModel, prompt: list[int], rows, max_new: int) -> tuple[str, float]:
    """Greedy answer text and time to first token (when the generation chose its first token).

    An answer that starts to repeat itself ends where the repetition begins."""
    eot = tuple(end_of_turn_ids(lm.tokenizer))
    first: list[float] = []
    start = time.perf_counter()
    out = generate(lm.model, [Stream(prompt, max_new, stop_ids=eot, loop_span=LOOP_SPAN)], batch_size=1,
                   prefix_rows=rows, progress=lambda _: first or first.append(time.perf_counter() - start))[0]
    ttft = first[0] if first else time.perf_counter() - start
    cut = loop_start(out.tokens, LOOP_SPAN)
    tokens = out.tokens if cut is None else out.tokens[:cut]
    text = lm.tokenizer.decode([t for t in tokens if t not in eot], skip_special_tokens=True)
    return text.strip(), ttft


def ask_arms(model: str | None, device: str | None, cartridges: list[str], question: str,
             corpus: list[str], max_new: int = 128, dtype: str | None = None) -> list[dict]:
    lm = load_model(model, device, dtype)
    arms = []
    prompt = student_prompt(lm.tokenizer, question)
    if cartridges:
        parts = []
        for path in cartridges:
            cart = load_cartridge(path, device=lm.device, dtype=lm.dtype)
            check_fits(cart, lm.fingerprint, path)
            parts.append(cart)
        rows = compose_rows(parts)
        text, ttft = answer(lm, prompt, rows, max_new)
        arms.append({"arm": "cartridge", "answer": text, "kv_rows": sum(c.p for c in parts) + len(prompt), "ttft_s": ttft})
    text, ttft = answer(lm, prompt, None, max_new)
    arms.append({"arm": "bare", "answer": text, "kv_rows": len(prompt), "ttft_s": ttft})
    if corpus:  # the corpus as a system turn, cut to leave the window room for the question and answer
        context, cut = document_context(lm, corpus_text(corpus), len(prompt) + max_new)
        icl = context + prompt
        text, ttft = answer(lm, icl, None, max_new)
        arms.append({"arm": "in-context", "answer": text, "kv_rows": len(icl), "ttft_s": ttft,
                     "corpus_tokens_cut": cut})
    return arms
