"""Every tested architecture end to end: the equivalence gate and one served request.

Llama and Qwen3 attend over everything; Gemma 3 mixes sliding and global layers with
one KV head; Mistral and Phi-3 slide on every layer. Prefixes here are longer than the tiny
window, so the window cuts through the cartridge rows.
"""

from __future__ import annotations

import pytest
import torch

from cartridges.core.chat import system_ids
from cartridges.evaluation.equiv import equivalence
from server.selector import render_prompt
from tests.serving import chat, greedy, start, write_cartridge
from tests.tiny import TINY, WINDOW

TEXT = "Sliding windows see the recent past; global layers see it all. " * 3


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("family", sorted(TINY))
def test_equivalence_gate_passes(family, parts):
    lm = TINY[family]()
    report = equivalence(lm, TEXT, p=24, suffix_max=32, parts=parts)
    assert report["prefix_rows"] == 24 * parts > WINDOW
    assert report["n"] == 32 and report["greedy_agree"] == 32
    assert report["max_abs_dlogit"] <= 1e-4
    assert report["pass"] is True


def naive_greedy(model: torch.nn.Module, ids: list[int], max_new: int) -> list[int]:
    """The reference: re-run the whole real sequence every step, no cache, no mask."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(max_new):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax().item()))
    return seq[len(ids) :]


@pytest.mark.parametrize("family", sorted(TINY))
def test_served_request_equals_greedy_over_the_real_prefix(family, tmp_path):
    """The server behind a corpus-init cartridge answers as the model does after a real
    prefill of the same p system-wrapped corpus tokens followed by the rendered question."""
    lm = TINY[family](torch.float64)
    p, question, n = 16, "What do sliding windows see?", 10
    path = write_cartridge(lm, tmp_path / "doc.safetensors", TEXT, p=p)
    real = system_ids(lm.tokenizer, TEXT)[:p] + render_prompt(lm.tokenizer, [{"role": "user", "content": question}])
    want = naive_greedy(lm.model, real, n)
    server = start(lm, [path])
    try:
        resp = chat(server.url, greedy("doc", question, max_tokens=n))
    finally:
        server.stop()
    assert resp.status_code == 200, resp.text
    body = resp.json()
    eot = server.engine.eot
    cut = next((i + 1 for i, t in enumerate(want) if t in eot), n)
    expected = lm.tokenizer.decode([t for t in want[:cut] if t not in eot], skip_special_tokens=True)
    assert body["choices"][0]["message"]["content"] == expected
    assert body["usage"]["completion_tokens"] == cut
