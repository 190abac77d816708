"""The server through the official `openai` client on loopback, behind cartridges on a tiny model."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from cartridges.core.batch import Stream
from cartridges.core.generate import generate
from server.main import reload_on_sighup
from server.selector import render_prompt
from tests.serving import TEXTS, chat, greedy, reference, start, write_cartridge
from tests.tiny import tiny_llama

QUESTIONS = [f"question {i}: " + "what and why " * (i % 5) for i in range(16)]


@pytest.fixture(scope="module")
def lm():
    return tiny_llama(torch.float64)


@pytest.fixture(scope="module")
def server(lm, tmp_path_factory):
    path = write_cartridge(lm, tmp_path_factory.mktemp("carts") / "fox.safetensors")
    srv = start(lm, [path], max_tokens_cap=1800)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["fox"]
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["prefix_rows"] == 16 and health["mode"] == "cartridge"


def test_completion_behind_the_cartridge_equals_generate_alone(lm, server, client):
    text, tokens = reference(lm, server, "Tell me about the fox.", 12)
    resp = client.chat.completions.create(model="fox", messages=[{"role": "user", "content": "Tell me about the fox."}],
                                          max_tokens=12, temperature=0)
    assert resp.choices[0].message.content == text
    assert resp.choices[0].finish_reason == ("stop" if tokens[-1] in server.engine.eot else "length")
    usage = resp.usage
    assert usage.completion_tokens == len(tokens) == 12
    assert usage.prompt_tokens == len(render_prompt(lm.tokenizer, [{"role": "user", "content": "Tell me about the fox."}]))
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert usage.model_extra["cartridge_rows"] == 16
    assert resp.model_extra["cartridges"] == ["fox"]
    # The cartridge matters (this random model barely reads it, so compare the logits' margins).
    prompt = render_prompt(lm.tokenizer, [{"role": "user", "content": "Tell me about the fox."}])
    rows = server.selector.select([{"role": "user", "content": "x"}]).rows
    behind, bare_model = (generate(lm.model, [Stream(prompt, 12)], prefix_rows=r)[0] for r in (rows, None))
    assert max(abs(a - b) for a, b in zip(behind.margins, bare_model.margins, strict=True)) > 1e-3


def test_streaming_gives_the_same_text_in_openai_chunks(server, client):
    question = "Stream me something."
    whole = client.chat.completions.create(model="fox", messages=[{"role": "user", "content": question}],
                                           max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model="fox", messages=[{"role": "user", "content": question}],
                                                 max_tokens=20, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert {c.id for c in chunks} == {chunks[0].id}
    raw = httpx.post(f"{server.url}/v1/chat/completions", json=greedy("fox", question, stream=True), timeout=30)
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_sixteen_concurrent_greedy_requests_each_equal_the_request_alone(server):
    alone = [chat(server.url, greedy("fox", q, 16)).json()["choices"][0]["message"]["content"] for q in QUESTIONS]
    assert len(set(alone)) > 1
    before = httpx.get(f"{server.url}/health").json()
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda q: chat(server.url, greedy("fox", q, 16)), QUESTIONS))
    assert all(r.status_code == 200 for r in together)
    assert [r.json()["choices"][0]["message"]["content"] for r in together] == alone
    after = httpx.get(f"{server.url}/health").json()
    assert after["peak_active"] > 4  # they really shared decode steps
    assert after["decode_steps"] - before["decode_steps"] < 16 * 16


def test_sampling_honours_seed_temperature_and_stop(server, client):
    def ask(**kw):
        r = client.chat.completions.create(model="fox", messages=[{"role": "user", "content": "Say it."}],
                                           max_tokens=24, **kw)
        return r.choices[0]

    a, b, c = ask(temperature=0.9, seed=7), ask(temperature=0.9, seed=7), ask(temperature=0.9, seed=8)
    assert a.message.content == b.message.content != c.message.content
    assert ask(temperature=0.9, top_p=1e-9, seed=3).message.content == ask(temperature=0).message.content
    full = ask(temperature=0).message.content
    stop = full[5:7]
    cut = ask(temperature=0, stop=[stop, "never-there"])
    assert cut.message.content == full[: full.index(stop)] and cut.finish_reason == "stop"


def test_client_disconnect_mid_stream_frees_its_slot(server):
    served = httpx.get(f"{server.url}/health").json()["served"]
    with httpx.Client(timeout=30) as http, http.stream(
        "POST", f"{server.url}/v1/chat/completions", json=greedy("fox", "Go on forever.", 1800, stream=True)
    ) as resp:
        lines = resp.iter_lines()
        seen = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in seen)
        assert httpx.get(f"{server.url}/health").json()["active"] == 1
    deadline = time.time() + 10
    while httpx.get(f"{server.url}/health").json()["active"] and time.time() < deadline:
        time.sleep(0.05)
    health = httpx.get(f"{server.url}/health").json()
    assert health["active"] == 0
    assert health["served"] == served  # dropped, not run to its 1800-token end
    assert chat(server.url, greedy("fox", "Still there?", 4)).status_code == 200


def test_api_key_is_required_when_set(lm, tmp_path):
    path = write_cartridge(lm, tmp_path / "fox.safetensors")
    srv = start(lm, [path], api_key="s3cret")
    try:
        assert chat(srv.url, greedy("fox", "hi", 2)).status_code == 401
        wrong = chat(srv.url, greedy("fox", "hi", 2), key="nope")
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{srv.url}/v1/models").status_code == 401
        assert httpx.post(f"{srv.url}/admin/reload").status_code == 401
        assert httpx.get(f"{srv.url}/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{srv.url}/v1", api_key="nope", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="s3cret", max_retries=0)
        assert ok.chat.completions.create(model="fox", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert httpx.post(f"{srv.url}/admin/reload", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    finally:
        srv.stop()


def test_reload_swaps_the_cartridge_for_new_requests_and_keeps_streams_in_flight(lm, tmp_path):
    path = tmp_path / "doc.safetensors"
    write_cartridge(lm, path, TEXTS["fox"])
    srv = start(lm, [path], max_tokens_cap=1800)
    try:
        question = "What is this about?"
        old_long, _ = reference(lm, srv, question, 1500)
        old_short, _ = reference(lm, srv, question, 12)
        with httpx.Client(timeout=60) as http, http.stream(
            "POST", f"{srv.url}/v1/chat/completions", json=greedy("doc", question, 1500, stream=True)
        ) as resp:
            lines = resp.iter_lines()
            next(lines)
            write_cartridge(lm, path, TEXTS["zlib"])
            reloaded = httpx.post(f"{srv.url}/admin/reload", timeout=30).json()
            assert reloaded["version"] == 2
            assert httpx.get(f"{srv.url}/health").json()["active"] == 1  # the old stream is still decoding
            new_short, _ = reference(lm, srv, question, 12)
            assert new_short != old_short  # the two cartridges answer differently
            answer = chat(srv.url, greedy("doc", question, 12)).json()
            assert answer["choices"][0]["message"]["content"] == new_short
            assert answer["system_fingerprint"] == "v2"
            streamed = "".join(_deltas(lines))
        assert streamed == old_long  # the stream that started before the reload kept its rows

        # SIGHUP does the same as POST /admin/reload.
        write_cartridge(lm, path, TEXTS["fox"])
        previous = signal.getsignal(signal.SIGHUP)
        reload_on_sighup(srv.selector)
        try:
            os.kill(os.getpid(), signal.SIGHUP)
            deadline = time.time() + 10
            while srv.selector.describe()["version"] < 3 and time.time() < deadline:
                time.sleep(0.05)
        finally:
            signal.signal(signal.SIGHUP, previous)
        assert srv.selector.describe()["version"] == 3
        assert chat(srv.url, greedy("doc", question, 12)).json()["choices"][0]["message"]["content"] == old_short
    finally:
        srv.stop()


def test_a_failed_reload_keeps_serving_the_previous_version(lm, tmp_path):
    path = write_cartridge(lm, tmp_path / "doc.safetensors")
    srv = start(lm, [path])
    try:
        before = chat(srv.url, greedy("doc", "hi", 6)).json()["choices"][0]["message"]["content"]
        path.write_bytes(path.read_bytes()[:100])  # truncated
        failed = httpx.post(f"{srv.url}/admin/reload", timeout=30)
        assert failed.status_code == 422 and failed.json()["error"]["code"] == "reload_failed"
        assert "truncated" in failed.json()["error"]["message"]
        assert chat(srv.url, greedy("doc", "hi", 6)).json()["choices"][0]["message"]["content"] == before
    finally:
        srv.stop()


def _deltas(lines):
    import json

    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                yield choice["delta"].get("content") or ""
