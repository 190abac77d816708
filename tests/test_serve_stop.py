"""`cartridges serve` on SIGTERM: stops taking connections, ends running streams within the
grace period (`server.main.GRACE_S`, 5 s: then they end with a 503 error in the stream), and exits 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from cartridges.core.chat import end_of_turn_ids
from cartridges.core.models import LoadedModel
from server.main import BACKSTOP_S, GRACE_S
from tests.serving import write_cartridge
from tests.tiny import tiny_llama

pytestmark = pytest.mark.reliability
REPO = Path(__file__).resolve().parents[1]
LONG = 50_000  # tokens asked per stream
ASCII = 128  # the byte-level tokenizer's first ids are the bytes


def endless_model_dir(path: Path) -> tuple[LoadedModel, Path]:
    """A tiny model whose greedy answers never end and stream as text: a long context, and zero rows
    in its output layer past the ASCII bytes (end-of-turn tokens among them), so their logit (0) is
    below the largest of the random others."""
    lm = tiny_llama()
    lm.model.config.max_position_embeddings = 2 * LONG  # room for answers far longer than the grace period
    with torch.no_grad():
        out = lm.model.get_output_embeddings().weight
        assert min(end_of_turn_ids(lm.tokenizer)) >= ASCII
        out[ASCII:] = 0.0
    lm.model.save_pretrained(path)
    lm.tokenizer.save_pretrained(path)
    return lm, path


def test_sigterm_stops_accepting_ends_streams_within_the_grace_period_and_exits_0(tmp_path):
    lm, model_dir = endless_model_dir(tmp_path / "model")
    cart = write_cartridge(lm, tmp_path / "c.safetensors")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "serve", "--model", str(model_dir), "--cartridge",
                             str(cart), "--port", "0", "--threads", "1", "--max-tokens-cap", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    try:
        url = None
        for line in proc.stdout:
            m = re.search(r"at (http://\S+)/v1", line)
            if m:
                url = m.group(1)
                break
        assert url, "server did not start"
        streams = [{"status": None, "tokens": 0, "done": False, "error": None, "cut": None} for _ in range(3)]

        def stream(state: dict) -> None:
            body = {"model": "c", "messages": [{"role": "user", "content": "go"}], "stream": True,
                    "max_tokens": LONG, "temperature": 0.0}
            try:
                with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
                    state["status"] = r.status_code
                    for line in r.iter_lines():
                        if line == "data: [DONE]":
                            state["done"] = True
                        elif line.startswith("data: "):
                            event = json.loads(line[6:])
                            if "error" in event:
                                state["error"] = event["error"]["code"]
                            elif event["choices"][0]["delta"].get("content"):
                                state["tokens"] += 1
            except httpx.HTTPError as exc:
                state["cut"] = type(exc).__name__

        threads = [threading.Thread(target=stream, args=(s,)) for s in streams]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while min(s["tokens"] for s in streams) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(s["status"] == 200 and s["tokens"] >= 5 for s in streams), streams  # all decoding
        proc.send_signal(signal.SIGTERM)
        began = time.monotonic()
        time.sleep(0.5)
        with pytest.raises(httpx.HTTPError):  # no new requests
            httpx.get(f"{url}/health", timeout=2)
        code = proc.wait(GRACE_S + 10)
        seconds = time.monotonic() - began
        for t in threads:
            t.join(10)
        out = proc.stdout.read()
        assert code == 0 and "Traceback" not in out, out[-6000:]
        # The streams ask for far more tokens than the grace period decodes: they run through it, then
        # each ends with the shutdown error and [DONE], its connection closed cleanly.
        assert GRACE_S - 0.5 < seconds < GRACE_S + BACKSTOP_S, seconds
        assert not any(t.is_alive() for t in threads), streams
        assert all(s["error"] == "server_shutting_down" and s["done"] and s["cut"] is None for s in streams), streams
        print(f"serve SIGTERM: exit {code} after {seconds:.2f} s; streams: {streams}")
    finally:
        if proc.poll() is None:
            proc.kill()
