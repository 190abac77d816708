"""The server on the default model, behind a corpus-initialized cartridge, through the `openai` client."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from cartridges.core.batch import Stream
from cartridges.core.generate import generate
from server.selector import render_prompt
from tests.serving import start, write_cartridge

QUESTIONS = (
    "What is a cartridge?",
    "Which model is the default?",
    "How do I train a cartridge on my own files?",
    "Hi",
)
MAX_TOKENS = 16


@pytest.mark.slow
def test_default_model_answers_behind_a_cartridge_alone_streamed_and_batched(default_lm, tmp_path):
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    path = write_cartridge(default_lm, tmp_path / "readme.safetensors", readme, p=64)
    srv = start(default_lm, [path])
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        rows = srv.selector.select([{"role": "user", "content": "x"}]).rows
        tok = default_lm.tokenizer
        alone = [
            generate(default_lm.model, [Stream(render_prompt(tok, [{"role": "user", "content": q}]), MAX_TOKENS,
                                               stop_ids=srv.engine.eot)], prefix_rows=rows)[0]
            for q in QUESTIONS
        ]

        def ask(q: str, **kw):
            return client.chat.completions.create(model="readme", messages=[{"role": "user", "content": q}],
                                                  max_tokens=MAX_TOKENS, temperature=0, **kw)

        def text(tokens: list[int]) -> str:
            return tok.decode([t for t in tokens if t not in srv.engine.eot], skip_special_tokens=True)

        # One request alone runs the same computation as `generate` alone: identical.
        single = ask(QUESTIONS[0])
        assert single.choices[0].message.content == text(alone[0].tokens)
        assert single.usage.model_extra["cartridge_rows"] == 64
        streamed = "".join(c.choices[0].delta.content or "" for c in ask(QUESTIONS[0], stream=True) if c.choices)
        assert streamed == single.choices[0].message.content

        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            together = list(pool.map(ask, QUESTIONS))
        assert srv.engine.stats()["peak_active"] > 2
        for q, got, ref in zip(QUESTIONS, together, alone, strict=True):
            # Equal up to the first near-tie (top-2 margin below 1e-3), where batch shape may flip a token.
            tie = next((i for i, m in enumerate(ref.margins) if m < 1e-3), len(ref.tokens))
            content = got.choices[0].message.content
            if tie == len(ref.tokens):
                assert content == text(ref.tokens), q
            else:
                assert content.startswith(text(ref.tokens[:tie]).rstrip("\ufffd")), q
    finally:
        srv.stop()
