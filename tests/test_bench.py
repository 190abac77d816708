"""`make bench` in quick mode: every benchmark runs and lands in one table, file and catalog."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.run_all import BENCHES
from storage.sql import query


def test_bench_quick_mode_writes_its_table(tmp_path):
    out, store = tmp_path / "BENCHMARKS.md", tmp_path / "store"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run_all", "--quick", "--out", str(out), "--store", str(store), "--json"],
        capture_output=True, text=True, timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = {(b.name, key) for b in BENCHES for key, _, _ in b.ratios}
    got = {(r["benchmark"], r["metric"]) for r in summary["rows"] if r["compares"] != "raw figure"}
    assert got == expected
    assert all(r["value"] > 0 for r in summary["rows"])
    text = out.read_text()
    for bench, key in expected:
        assert f"| {bench} | `{key}` |" in text
    _, rows = query(store, "SELECT benchmark, metric, value, quick FROM benchmarks")
    assert {(b, m) for b, m, _, _ in rows} >= expected and all(q for *_, q in rows)


def test_regenerating_the_table_keeps_the_notes_below_the_marker(tmp_path):
    from bench.run_all import KEEP, kept_notes

    path = tmp_path / "BENCHMARKS.md"
    assert kept_notes(path) == ""
    path.write_text("# Benchmarks\n\n| old table |\n")
    assert kept_notes(path) == ""
    path.write_text(f"# Benchmarks\n\n| old table |\n\n{KEEP}\n\n## Levers\n\nmeasured by hand\n")
    assert kept_notes(path) == f"\n{KEEP}\n\n## Levers\n\nmeasured by hand\n"
