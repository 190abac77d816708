"""A one-minute soak on a tiny model: `python -m bench.soak --json` reports its figures in the documented shape."""

from __future__ import annotations

import json
import math

import pytest

from bench.soak import main

pytestmark = pytest.mark.reliability

WINDOW_KEYS = {"start_s", "end_s", "requests", "errors", "p50_ms", "p99_ms", "reloads", "rss_ratio_end",
               "rss_ratio_max"}


def test_a_short_soak_with_reloads_has_no_errors_and_reports_windows_latency_and_memory(tmp_path, capsys):
    code = main(["--model", "tiny", "--minutes", "1", "--window-s", "20", "--publish-every-s", "12",
                 "--clients", "8", "--max-tokens", "16", "--warmup-s", "10", "--work", str(tmp_path), "--json"])
    out = capsys.readouterr().out
    print(out)
    r = json.loads(out.strip().splitlines()[-1])  # the last line is the JSON object
    assert code == 0
    assert r["errors"] == 0 and r["error_samples"] == [] and r["server_alive"] and r["server_failures"] == 0
    assert set(r["kinds"]) == {"plain", "stream", "abandon", "conversation", "follow-up"}
    assert r["requests"] == sum(r["kinds"].values()) == sum(w["requests"] for w in r["windows"])

    assert r["window_s"] == 20 and [(w["start_s"], w["end_s"]) for w in r["windows"]] == [(0, 20), (20, 40), (40, 60)]
    for w in r["windows"]:
        assert set(w) == WINDOW_KEYS and w["errors"] == 0 and w["requests"] > 0
        assert 0 < w["p50_ms"] <= w["p99_ms"] and w["rss_ratio_end"] > 0
    assert r["p99_drift"] == r["windows"][-1]["p99_ms"] / r["windows"][0]["p99_ms"]

    # Versions were published and reloaded while the clients ran; the server ends on the last one.
    versions = [p["version"] for p in r["publishes"]]
    assert versions[0] == "0001" and r["published"] == len(versions) - 1 >= 2
    assert r["reloads"] == r["published"] and r["fleet_version_end"] == versions[-1]
    assert sum(w["reloads"] for w in r["windows"]) >= r["published"] - 1
    assert len(r["fleet_versions_served"]) >= 2 and set(r["fleet_versions_served"]) <= set(versions)

    # RSS over time, as a ratio to its value after warm-up, with the KV rows kept for conversations.
    assert r["rss_warm_mib"] > 0 and r["rss"][0][1] == pytest.approx(1, abs=0.05)
    assert [t for t, _, _ in r["rss"]] == sorted(t for t, _, _ in r["rss"]) and len(r["rss"]) >= 10
    assert all(rows >= 0 for _, _, rows in r["rss"]) and r["max_conversation_rows_kept"] > 0  # kept KV, beside RSS
    assert math.isclose(r["rss_ratio_end"], r["rss"][-1][1], abs_tol=1e-4)
    assert r["rss_ratio_max"] >= r["rss_ratio_end"] and r["cpu"] and r["minutes"] >= 1
    assert "serving 'soak' (fleet of 3 documents, 2 per conversation on tiny-llama, cpu, " in r["server"]
