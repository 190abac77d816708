"""Refactors keep what the pipeline computes: the smoke runs match the recorded digests.

See `tests/smoke_guard.py` for what is compared and how to re-record after an intended change.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from tests.smoke_guard import GOLDEN, close, machine, run_smoke


def test_smoke_runs_give_the_recorded_artifacts_rows_and_files():
    golden = json.loads(GOLDEN.read_text())
    now = run_smoke()
    assert sorted(now["exact"]) == sorted(golden["exact"]), "a different set of artifacts"
    differences = close(now["loose"], golden["loose"])
    assert not differences, "\n".join(differences[:20])
    if golden["machine"] == machine():  # float sums agree to the last bit only on the same kernels
        changed = [k for k in golden["exact"] if now["exact"][k] != golden["exact"][k]]
        assert not changed, f"not byte-identical: {changed}"


def test_the_guard_sees_a_changed_value():
    golden = json.loads(GOLDEN.read_text())
    key = next(k for k in golden["loose"] if k.startswith("train/"))
    changed = json.loads(json.dumps(golden["loose"]))
    cartridge = changed[key]["cartridge.safetensors"][0]
    tensor = next(iter(cartridge))
    cartridge[tensor][1][1] *= 1.001  # the tensor's sum, off by a tenth of a percent
    assert close(changed, golden["loose"]) and not close(golden["loose"], golden["loose"])


def test_the_guard_holds_on_the_other_kernels_of_this_cpu():
    """CI machines differ in CPU kernels (AVX512 or AVX2): the loose level must pass on both."""
    other = "avx2" if torch.backends.cpu.get_cpu_capability() != "AVX2" else "default"
    code = "import json; from tests.smoke_guard import run_smoke; print(json.dumps(run_smoke()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "ATEN_CPU_CAPABILITY": other})
    now = json.loads(done.stdout.strip().splitlines()[-1])
    golden = json.loads(GOLDEN.read_text())
    assert sorted(now["exact"]) == sorted(golden["exact"])
    differences = close(now["loose"], golden["loose"])
    assert not differences, "\n".join(differences[:20])
