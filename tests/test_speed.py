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
    record = lm.dtype_record()
    assert (record["dtype"], record["dtype_reason"]) == ("float32", "requested")


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


def fake_stat(path, samples: list[list[tuple[int, int]]]):
    """A /proc/stat that shows `samples` in turn: per CPU, (busy ticks, idle ticks)."""
    def write(sample):
        lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
        lines += [f"cpu{i} {busy} 0 0 {idle} 0 0 0 0 0 0" for i, (busy, idle) in enumerate(sample)]
        path.write_text("\n".join(lines) + "\n")
    write(samples[0])
    return lambda _seconds: write(samples[1])


def test_threads_follow_the_cores_idle_at_start(monkeypatch, tmp_path):
    stat = tmp_path / "stat"
    monkeypatch.setattr(speed.time, "sleep", fake_stat(stat, [[(100, 100), (100, 100)], [(200, 100), (100, 200)]]))
    assert speed.idle_cores([0, 1], stat=stat) == pytest.approx(1.0)  # cpu0 busy throughout, cpu1 idle
    monkeypatch.setattr(speed.time, "sleep", fake_stat(stat, [[(100, 100), (100, 100)], [(200, 100), (100, 200)]]))
    assert speed.idle_cores([1], stat=stat) == pytest.approx(1.0)  # only the cores this process may use count
    for env in (speed.THREADS_ENV, "OMP_NUM_THREADS"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(speed.os, "sched_getaffinity", lambda pid: {0, 1})
    kept = torch.get_num_threads()
    try:
        monkeypatch.setattr(speed, "idle_cores", lambda cpus: 1.1)
        assert speed.choose_threads() == (1, "1.1 of the 2 cores this process may use were idle at start")
        assert torch.get_num_threads() == 1 and speed.threads_record()["threads"] == 1
        monkeypatch.setattr(speed, "idle_cores", lambda cpus: 0.2)  # all busy: still one thread
        assert speed.choose_threads()[0] == 1
        monkeypatch.setattr(speed, "idle_cores", lambda cpus: 1.9)
        assert speed.choose_threads()[0] == 2
        monkeypatch.setenv(speed.THREADS_ENV, "3")
        assert speed.choose_threads() == (3, f"{speed.THREADS_ENV}=3")
        monkeypatch.setenv(speed.THREADS_ENV, "many")
        with pytest.raises(ValueError, match=f"{speed.THREADS_ENV}='many'"):
            speed.choose_threads()
    finally:
        torch.set_num_threads(kept)


def test_a_commands_json_records_its_threads(tmp_path, tiny_model_dir, capsys, monkeypatch):
    from cli.main import main

    monkeypatch.setenv(speed.THREADS_ENV, "1")
    assert main(["model", "--model", str(tiny_model_dir), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["threads"] == 1 and out["threads_reason"] == f"{speed.THREADS_ENV}=1"
