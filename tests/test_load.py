"""A small version of `bench/load_serve.py`: the server under concurrent, abandoned and malformed requests."""

from __future__ import annotations

import pytest

from bench.load_serve import run, table

pytestmark = pytest.mark.reliability


def test_concurrent_streams_and_disconnects_answer_everything_without_memory_growth():
    r = run(requests=80, clients=16, max_batch=4, max_tokens=8, warmup=16, abandon=0.2, malformed=0.1, seed=3)
    print(table(r))
    assert r["errors"] == 0, r["error_samples"]
    assert r["answered_ok"] == r["well_formed"] > 0 and r["abandoned"] > 0 and r["malformed_4xx"] == r["malformed"] > 0
    assert r["peak_active"] <= r["max_batch"] and r["server_failures"] == 0 and r["server_alive"]
    assert r["rss_growth"] <= 0.10
