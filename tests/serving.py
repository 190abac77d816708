"""Helpers for server tests: tiny cartridges on disk and a live server on a free loopback port."""

from __future__ import annotations

from pathlib import Path

import httpx

from cartridges.core.batch import Stream
from cartridges.core.cartridge import init_from_corpus
from cartridges.core.files import save_cartridge
from cartridges.core.generate import generate
from cartridges.core.models import LoadedModel
from server.main import Server
from server.options import ServeConfig
from server.selector import CartridgeSelector, render_prompt

TEXTS = {
    "fox": "The quick brown fox jumps over the lazy dog. " * 4,
    "zlib": "zlib wraps DEFLATE streams with a header and an Adler-32 checksum. " * 3,
}


def write_cartridge(lm: LoadedModel, path: Path, text: str = TEXTS["fox"], p: int = 16) -> Path:
    return save_cartridge(path, init_from_corpus(lm, text, p), lm.fingerprint)


def start(lm: LoadedModel, paths: list[Path], **config) -> Server:
    selector = CartridgeSelector(lm, [str(p) for p in paths])
    return Server(lm, selector, ServeConfig(port=0, **config)).start()


def reference(lm: LoadedModel, server: Server, content: str, max_tokens: int) -> tuple[str, list[int]]:
    """What the request should answer: greedy `generate` alone behind the server's current rows."""
    sel = server.selector.select([{"role": "user", "content": content}])
    eot = server.engine.eot
    out = generate(lm.model, [Stream(render_prompt(lm.tokenizer, [{"role": "user", "content": content}]),
                                     max_tokens, stop_ids=eot)], batch_size=1, prefix_rows=sel.rows)[0]
    text = lm.tokenizer.decode([t for t in out.tokens if t not in eot], skip_special_tokens=True)
    return text, out.tokens


def chat(url: str, body: dict, key: str | None = None, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60, **kwargs)


def greedy(model: str, content: str, max_tokens: int = 12, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **extra}
