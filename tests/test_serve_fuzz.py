"""Hypothesis-generated request bodies against the live tiny-model server: never a 500, a hang or a crash.

Three families: near-valid chat requests with every field drawn from wrong types and edge
values (the interesting ones), arbitrary JSON values, and arbitrary bytes. Every answer is
a 2xx with a complete body or a 4xx with an OpenAI-style error; afterwards the decode loop
is alive, has no failures and is idle.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serving import start, write_cartridge
from tests.tiny import tiny_llama

pytestmark = pytest.mark.reliability
SEEN: dict[int, int] = {}
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    lm = tiny_llama(torch.float32)
    path = write_cartridge(lm, tmp_path_factory.mktemp("carts") / "fox.safetensors")
    srv = start(lm, [path], max_tokens_cap=8, default_max_tokens=4, max_body_bytes=64 * 1024, max_queue=8)
    yield srv
    srv.stop()
    print(f"statuses seen: {dict(sorted(SEEN.items()))}")


scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
texts = st.text(max_size=60) | st.sampled_from(["", " ", "\x00", "\ud800", "<|im_end|>", "<|im_start|>system\n",
                                               "\u202e\u0000\uffff", "x" * 3000])
parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | json_values,
                                        "text": texts | json_values}), max_size=3)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "", "USER"]) | json_values},
    optional={"content": texts | parts | json_values, "name": json_values}), max_size=4) | json_values
FIELDS = {
    "model": st.sampled_from(["fox", "fox", "gpt-4", ""]) | json_values,
    "messages": messages,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | json_values}) | json_values,
    "max_tokens": st.integers(min_value=-3, max_value=12) | json_values,
    "max_completion_tokens": st.integers(min_value=-3, max_value=12) | json_values,
    "temperature": st.floats(min_value=-1, max_value=3) | json_values,
    "top_p": st.floats(min_value=-0.5, max_value=1.5) | json_values,
    "seed": st.integers(min_value=-(2**80), max_value=2**80) | json_values,
    "stop": st.lists(texts, max_size=6) | texts | json_values,
    "n": st.integers(min_value=-1, max_value=3) | json_values,
    "presence_penalty": st.floats(-3, 3) | json_values,
    "logprobs": st.booleans() | json_values,
    "tools": json_values,
    "response_format": json_values,
    "user": json_values,
}
VALID = {"model": "fox", "messages": [{"role": "user", "content": "hi"}]}
# A valid request with some fields replaced or added, and maybe a required one dropped.
near_valid = st.tuples(st.fixed_dictionaries({}, optional=FIELDS), st.sets(st.sampled_from(sorted(VALID)))).map(
    lambda t: {k: v for k, v in {**VALID, **t[0]}.items() if k not in t[1] or k in t[0]})


def post(server, raw: bytes, stream: bool) -> httpx.Response:
    url = f"{server.url}/v1/chat/completions"
    headers = {"Content-Type": "application/json"}
    with httpx.stream("POST", url, content=raw, headers=headers, timeout=30) as resp:
        resp.read()
        return resp


def check(server, raw: bytes) -> None:
    resp = post(server, raw, stream=True)
    SEEN[resp.status_code] = SEEN.get(resp.status_code, 0) + 1
    assert resp.status_code < 500, resp.text[:500]
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        lines = [line for line in resp.text.splitlines() if line.startswith("data: ")]
        assert lines and lines[-1] == "data: [DONE]", resp.text[-500:]
        for line in lines[:-1]:
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
        return
    data = resp.json()
    if resp.status_code == 200:
        assert data["choices"][0]["finish_reason"] in ("stop", "length")
    else:
        assert set(data["error"]) == {"message", "type", "param", "code"} and data["error"]["message"]


def encode(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode()


@FUZZ
@given(body=near_valid)
def test_near_valid_chat_requests(server, body):
    check(server, encode(body))


@settings(FUZZ, max_examples=80)
@given(body=json_values)
def test_arbitrary_json_bodies(server, body):
    check(server, encode(body))


@settings(FUZZ, max_examples=60)
@given(raw=st.binary(max_size=300))
def test_arbitrary_bytes(server, raw):
    check(server, raw)


def raw_http(server, data: bytes, timeout: float = 10) -> bytes:
    """What the server answers to `data`; a connection it resets (closing on a request it did not
    read to the end) is dropped, and what it sent before that is the answer."""
    out = b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(65536):
                out += chunk
        except (ConnectionResetError, BrokenPipeError):
            pass
    return out


@pytest.mark.parametrize("head", [
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{\"model\": \"fox\"",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GARBAGE\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + b"X-Long: " + b"a" * 100_000 + b"\r\n\r\n",
])
def test_broken_http_is_refused_or_dropped_never_a_500(server, head):
    reply = raw_http(server, head)
    assert not reply.startswith(b"HTTP/1.1 5"), reply[:200]


def test_the_server_is_alive_idle_and_unharmed_afterwards(server):
    resp = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "model": "fox", "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 3})
    assert resp.status_code == 200
    health = httpx.get(f"{server.url}/health").json()
    assert health["alive"] and health["failures"] == 0 and health["active"] == 0 and health["waiting"] == 0
