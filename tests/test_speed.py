"""`--dtype auto` picks the dtype that is fastest on the machine at hand: float32 where the CPU
has no native bfloat16, bfloat16 only where a probe measures it clearly faster; the choice and
its reason reach the run summary and `--json`."""

from __future__ import annotations

import json

import pytest
import torch

from cartridges.core import speed
from cartridges.core.models import load_model


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def fake_cpu(monkeypatch, capability: str, speedup: float | None) -> list:
    """Pretend to be a CPU with `capability` whose probe measures `speedup`; return the probe calls."""
    calls = []

    def probe(shape, reps=5):
        if speedup is None:
            raise AssertionError("the probe must not run on this CPU")
        calls.append(shape)
        return speedup

    monkeypatch.setattr(speed, "cpu_capability", lambda: capability)
    monkeypatch.setattr(speed, "probe_bf16_speedup", probe)
    return calls


def test_avx2_takes_float32_without_probing(monkeypatch):
    fake_cpu(monkeypatch, "AVX2", None)
    choice = speed.choose_dtype(torch.device("cpu"), (576, 1536))
    assert choice.dtype is torch.float32 and "AVX2" in choice.reason


def test_native_bfloat16_takes_bfloat16_when_measured_faster(monkeypatch):
    calls = fake_cpu(monkeypatch, "AVX512", 3.1)
    choice = speed.choose_dtype(torch.device("cpu"), (576, 1536))
    assert choice.dtype is torch.bfloat16 and "3.10x" in choice.reason and calls == [(576, 1536)]


def test_avx512_without_bfloat16_units_takes_float32_by_measurement(monkeypatch):
    fake_cpu(monkeypatch, "AVX512", 0.05)  # AVX-512 but no BF16 instructions: emulated, slow
    assert speed.choose_dtype(torch.device("cpu"), (576, 1536)).dtype is torch.float32
    fake_cpu(monkeypatch, "AVX512", speed.MIN_SPEEDUP * 0.9)  # a near tie is not worth the rounding
    assert speed.choose_dtype(torch.device("cpu"), (64, 128)).dtype is torch.float32


def test_the_probe_runs_once_per_machine_and_shape(monkeypatch):
    calls = fake_cpu(monkeypatch, "AVX512", 2.0)
    first = speed.choose_dtype(torch.device("cpu"), (576, 1536))
    again = speed.choose_dtype(torch.device("cpu"), (576, 1536))
    assert calls == [(576, 1536)] and "cached probe" in again.reason and first.dtype is again.dtype
    speed.choose_dtype(torch.device("cpu"), (64, 256))  # another model's shape is measured anew
    assert calls == [(576, 1536), (64, 256)]
    assert len(json.loads(speed.cache_path().read_text())) == 2


def test_a_damaged_cache_is_measured_again(monkeypatch):
    calls = fake_cpu(monkeypatch, "AVX512", 2.0)
    speed.cache_path().parent.mkdir(parents=True)
    speed.cache_path().write_text("{not json")
    assert speed.choose_dtype(torch.device("cpu"), (576, 1536)).dtype is torch.bfloat16 and len(calls) == 1


def test_the_real_probe_compares_the_two_dtypes_on_this_machine():
    ratio = speed.probe_bf16_speedup((64, 128), reps=2)
    assert ratio > 0 and ratio == ratio  # a finite ratio of two timings


def test_an_explicit_dtype_is_never_probed(monkeypatch, tiny_model_dir):
    fake_cpu(monkeypatch, "AVX512", None)
    lm = load_model(str(tiny_model_dir), "cpu", "float32")
    assert lm.dtype_record() == {"dtype": "float32", "dtype_reason": "requested"}


@pytest.mark.parametrize(("capability", "speedup", "expected"),
                         [("AVX2", None, "float32"), ("AVX512", 3.0, "bfloat16")])
def test_train_without_dtype_records_the_machine_choice(monkeypatch, tmp_path, tiny_model_dir, capsys,
                                                        capability, speedup, expected):
    from cli.main import main
    from tests.test_pipeline import CORPUS

    fake_cpu(monkeypatch, capability, speedup)
    corpus = tmp_path / "corpus.md"
    corpus.write_text(CORPUS)
    code = main(["train", "--model", str(tiny_model_dir), "--preset", "smoke", "--no-prefect", "--no-filter",
                 "--corpus", str(corpus), "--store", str(tmp_path / "store"), "--json"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code in (0, 3)  # a tiny random model may fail the health check; the dtype is what counts
    assert summary["dtype"] == expected and summary["dtype_reason"]
    assert capability in summary["dtype_reason"]
    assert ("probe" in summary["dtype_reason"]) == (speedup is not None)
