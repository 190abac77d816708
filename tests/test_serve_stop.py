"""`cartridges serve` on SIGTERM: stops taking connections, ends running streams within the
grace period (uvicorn's `timeout_graceful_shutdown`, 5 s), and exits 0."""

from __future__ import annotations

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
from tests.serving import write_cartridge
from tests.tiny import tiny_llama

pytestmark = pytest.mark.reliability
REPO = Path(__file__).resolve().parents[1]
GRACE_S = 5.0


def endless_model_dir(path: Path) -> tuple[LoadedModel, Path]:
    """A tiny model whose greedy answers never end: the end-of-turn rows of its output layer
    are zero, so their logit (0) is below the largest of the random others."""
    lm = tiny_llama()
    with torch.no_grad():
        lm.model.get_output_embeddings().weight[end_of_turn_ids(lm.tokenizer)] = 0.0
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
        started: list[int] = []
        ends: list[str] = []

        def stream() -> None:
            body = {"model": "x", "messages": [{"role": "user", "content": "go"}], "stream": True,
                    "max_tokens": 50000, "temperature": 0.0}
            try:
                with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
                    for i, chunk in enumerate(r.iter_lines()):
                        if chunk and i == 0:
                            started.append(1)
                    ends.append("finished")
            except httpx.HTTPError as exc:
                ends.append(f"cut: {type(exc).__name__}")

        threads = [threading.Thread(target=stream) for _ in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(started) + len(ends) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(started) == 3, ends  # every stream is running when the signal comes
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
        assert code == 0 and "Traceback" not in out, out[-3000:]
        assert seconds < GRACE_S + 5 and len(ends) == 3
        print(f"serve SIGTERM: exit {code} after {seconds:.2f} s; streams: {ends}")
    finally:
        if proc.poll() is None:
            proc.kill()
