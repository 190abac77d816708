"""Bad input gets an OpenAI-style error body and a 4xx status, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.serving import chat, greedy, start, write_cartridge
from tests.tiny import tiny_llama

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    lm = tiny_llama(torch.float32)
    path = write_cartridge(lm, tmp_path_factory.mktemp("carts") / "fox.safetensors")
    srv = start(lm, [path], max_tokens_cap=512, max_body_bytes=LIMIT)
    yield srv
    srv.stop()


def user(content) -> list[dict]:
    return [{"role": "user", "content": content}]


# (name, body, status, error param or None, error code or None)
BAD_BODIES = [
    ("no messages", {"model": "fox"}, 400, "messages", None),
    ("empty messages", {"model": "fox", "messages": []}, 400, "messages", "empty_messages"),
    ("messages not a list", {"model": "fox", "messages": "hi"}, 400, "messages", None),
    ("content of the wrong type", {"model": "fox", "messages": user(5)}, 400, "messages.0.content", None),
    ("unknown role", {"model": "fox", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", None),
    ("image part", {"model": "fox", "messages": user([{"type": "image_url", "image_url": {"url": "x"}}])}, 400,
     "messages.0.content.0.type", None),
    ("temperature as a string", {"model": "fox", "messages": user("hi"), "temperature": "0.5"}, 400, "temperature",
     None),
    ("temperature out of range", {"model": "fox", "messages": user("hi"), "temperature": 3}, 400, "temperature", None),
    ("top_p zero", {"model": "fox", "messages": user("hi"), "top_p": 0}, 400, "top_p", None),
    ("max_tokens as a string", {"model": "fox", "messages": user("hi"), "max_tokens": "12"}, 400, "max_tokens", None),
    ("max_tokens zero", {"model": "fox", "messages": user("hi"), "max_tokens": 0}, 400, "max_tokens", None),
    ("max_tokens over the cap", {"model": "fox", "messages": user("hi"), "max_tokens": 513}, 400, "max_tokens",
     "max_tokens_over_cap"),
    ("stream not a bool", {"model": "fox", "messages": user("hi"), "stream": "yes"}, 400, "stream", None),
    ("seed a float", {"model": "fox", "messages": user("hi"), "seed": 1.5}, 400, "seed", None),
    ("too many stops", {"model": "fox", "messages": user("hi"), "stop": list("abcde")}, 400, "stop", None),
    ("n > 1", {"model": "fox", "messages": user("hi"), "n": 2}, 400, "n", None),
    ("tools", {"model": "fox", "messages": user("hi"), "tools": [{"type": "function"}]}, 400, "tools", None),
    ("model missing", {"messages": user("hi")}, 400, "model", None),
    ("unknown model", {"model": "gpt-4", "messages": user("hi")}, 404, "model", "model_not_found"),
    ("prompt longer than the context", {"model": "fox", "messages": user("x" * 2100)}, 400, "messages",
     "context_length_exceeded"),
    ("max_tokens past the context", {"model": "fox", "messages": user("x" * 1900), "max_tokens": 200}, 400,
     "max_tokens", "context_length_exceeded"),
]


def assert_error(resp: httpx.Response, status: int, param=None, code=None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


@pytest.mark.parametrize(("name", "body", "status", "param", "code"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_request_bodies(server, name, body, status, param, code):
    assert_error(chat(server.url, body), status, param, code)


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe", b"[1, 2]", b"", b"null"])
def test_malformed_json(server, raw):
    resp = httpx.post(f"{server.url}/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    assert_error(resp, 400, code="invalid_json")


def test_body_over_the_size_limit(server):
    big = greedy("fox", "x" * (LIMIT + 10))
    assert_error(chat(server.url, big), 413, code="request_too_large")

    def chunks():  # no Content-Length: the limit is counted as the body arrives
        yield b'{"model": "fox", "messages": [{"role": "user", "content": "'
        for _ in range(LIMIT // 1024 + 2):
            yield b"x" * 1024
        yield b'"}]}'

    resp = httpx.post(f"{server.url}/v1/chat/completions", content=chunks(), timeout=30)
    assert_error(resp, 413, code="request_too_large")


def test_unknown_routes_and_methods(server):
    assert_error(httpx.get(f"{server.url}/v1/nothing"), 404)
    assert_error(httpx.get(f"{server.url}/v1/chat/completions"), 405)


def test_the_server_still_serves_after_bad_input(server):
    for _name, body, *_ in BAD_BODIES[:5]:
        chat(server.url, body)
    resp = chat(server.url, greedy("fox", "still fine?", 3))
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    health = httpx.get(f"{server.url}/health").json()
    assert health["alive"] and health["failures"] == 0 and health["active"] == 0 and health["waiting"] == 0
