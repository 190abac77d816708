"""The GPU check (bench/gpu_check.py) as it would run on the bare accelerator machine, on the CPU.

The dry run here uses the project's interpreter with the packages that machine lacks made
unimportable; `make gpu-check-dry` runs the same check in a clean environment holding only
that machine's packages. The planted-bug tests show that each correctness check fails when
the engine is wrong in the way it is meant to catch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu import correct
from bench.gpu.dry_run import (
    LIMIT,
    MAX_FILES,
    MISSING,
    bare_command,
    bare_prologue,
    tree_bytes,
    wheel_bytes,
)
from bench.gpu.shapes import MODELS
from cartridges.core import prefix

REPO = Path(__file__).resolve().parent.parent
TEXT = (REPO / "docs" / "corpus" / "deflate.md").read_text()
CPU = torch.device("cpu")


def bare_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    return {**env, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def test_dry_run_passes_without_the_packages_the_accelerator_lacks(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        bare_command(sys.executable, "bench.gpu_check", ["--device", "cpu", "--tiny", "--threads", "2", "--out", str(out)]),
        cwd=REPO, env=bare_env(), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    files = sorted(p.name for p in out.iterdir())
    assert files == ["gpu_check.json", "gpu_check.log"] and len(files) <= MAX_FILES
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["pass"] and summary["mode"] == "tiny" and summary["failed_checks"] == 0
    assert all(s["status"] == "ok" for s in summary["sections"])
    correct_rows = summary["correct"]
    # two families x (gate + gradients) x two dtypes x two part counts, plus two gradchecks each
    assert len(correct_rows) == 2 * (2 * 2 * 2 + 2) and all(r["pass"] for r in correct_rows)
    assert {(r["dtype"], r["parts"]) for r in correct_rows if r["check"] == "gate"} == {
        ("float32", 1), ("float32", 2), ("bfloat16", 1), ("bfloat16", 2)}
    assert set(summary["models"]) == set(MODELS)
    for figures in summary["models"].values():
        assert figures["selfstudy"]["conversations_per_s"] > 0
        assert figures["selfstudy"]["supervised_tokens"] == 14 * 8  # every answer runs its whole budget
        assert figures["ttft"]["ttft_icl_ms"] > 0 and figures["ttft"]["ttft_cartridge_ms"] > 0
        assert figures["decode"]["decode_tokens_per_s_1"] > 0 and figures["decode"]["decode_tokens_per_s_16"] > 0
    assert "PASS: 20/20 checks passed" in (out / "gpu_check.log").read_text()


def test_the_stand_in_really_hides_the_missing_packages():
    """Without this the dry run above would prove nothing: the catalog needs DuckDB."""
    code = "import importlib.util\nprint([m for m in sys.argv[1:] if importlib.util.find_spec(m)])\nimport storage.catalog\n"
    proc = subprocess.run([sys.executable, "-c", bare_prologue() + code, *MISSING], cwd=REPO, env=bare_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr and "duckdb" in proc.stderr


def test_no_gpu_is_one_clear_line(tmp_path):
    env = {**bare_env(), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--out", str(tmp_path / "o")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: no CUDA device") and len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_what_a_device_call_carries_is_under_the_limit():
    assert tree_bytes() + wheel_bytes() < LIMIT


def test_the_checks_pass_on_the_engine_as_it_is():
    assert correct.gate("llama", "float32", 1, CPU, TEXT, 32, 16)["pass"]
    assert correct.gradients("llama", "float32", 2, CPU)["pass"]
    assert correct.finite_differences("qwen3", 2, CPU)["pass"]


def test_gate_catches_rows_at_the_wrong_positions(monkeypatch):
    real = prefix.layout

    def shifted(p, *args, **kwargs):
        positions, allowed = real(p, *args, **kwargs)
        return positions + 1, allowed

    monkeypatch.setattr(prefix, "layout", shifted)
    row = correct.gate("llama", "float32", 1, CPU, TEXT, 32, 16)
    assert not row["pass"] and row["max_abs_dlogit"] > 5 * row["scaled_tolerance"]


def test_gradient_check_catches_packed_segments_that_do_not_restart(monkeypatch):
    real = prefix.layout

    def unrestarted(p, input_shape, attention_mask=None, segment_ids=None, device=None):
        positions, allowed = real(p, input_shape, attention_mask, segment_ids, device)
        if segment_ids is not None:  # packed rows: positions run on across segments
            positions = p + torch.arange(input_shape[1], device=positions.device).expand_as(positions)
        return positions, allowed

    monkeypatch.setattr(prefix, "layout", unrestarted)
    row = correct.gradients("qwen3", "float32", 1, CPU)
    assert not row["pass"] and row["rel_error_packed"] > 100 * row["tolerance"]
    assert row["rel_error_flat"] <= row["tolerance"]  # the flat path never packs


def test_finite_differences_catch_a_backward_that_loses_half_the_gradient(monkeypatch):
    real = prefix.PrefixCache.__init__

    def halved(self, rows, batch):
        real(self, rows, batch)
        self._rows = [(0.5 * k + (0.5 * k).detach(), 0.5 * v + (0.5 * v).detach()) for k, v in self._rows]

    monkeypatch.setattr(prefix.PrefixCache, "__init__", halved)
    row = correct.finite_differences("llama", 1, CPU)
    assert not row["pass"] and row["rel_error"] == pytest.approx(0.5, abs=0.05)
