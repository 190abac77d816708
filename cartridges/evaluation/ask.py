"""Answering one question three ways: behind cartridge(s), bare, and with the corpus in context."""

from __future__ import annotations

import time

from cartridges.core.batch import Stream
from cartridges.core.cartridge import compose_rows
from cartridges.core.chat import chat_ids, end_of_turn_ids, without_system
from cartridges.core.corpus import corpus_text
from cartridges.core.files import check_fits, load_cartridge
from cartridges.core.generate import LOOP_SPAN, generate, loop_start
from cartridges.core.models import LoadedModel, load_model


def student_prompt(tokenizer, question: str) -> list[int]:
    """The question as the student saw it in training: no system turn, none injected."""
    return without_system(tokenizer, [{"role": "system", "content": "-"}, {"role": "user", "content": question}],
                          add_generation_prompt=True)


def answer(lm: LoadedModel, prompt: list[int], rows, max_new: int) -> tuple[str, float]:
    """Greedy answer text and time to first token (a one-token generation of the same prompt).

    An answer that starts to repeat itself ends where the repetition begins."""
    eot = tuple(end_of_turn_ids(lm.tokenizer))
    start = time.perf_counter()
    generate(lm.model, [Stream(prompt, 1, stop_ids=eot)], batch_size=1, prefix_rows=rows)
    ttft = time.perf_counter() - start
    out = generate(lm.model, [Stream(prompt, max_new, stop_ids=eot, loop_span=LOOP_SPAN)], batch_size=1,
                   prefix_rows=rows)[0]
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
    if corpus:
        messages = [{"role": "system", "content": corpus_text(corpus)}, {"role": "user", "content": question}]
        icl = chat_ids(lm.tokenizer, messages, add_generation_prompt=True)
        text, ttft = answer(lm, icl, None, max_new)
        arms.append({"arm": "in-context", "answer": text, "kv_rows": len(icl), "ttft_s": ttft})
    return arms
