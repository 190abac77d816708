"""Polite stops: SIGINT or SIGTERM at a known step of a real child process; it must exit within 15 s
with 130 or 143 and one line naming the stage, leave a consistent store, and the rerun must reach
exactly the uninterrupted run's results (the crash harness's comparison).

The child halts itself at a fault point (`CARTRIDGES_FAULT=<point>:stop`, SIGSTOP); the test sends
the signal and SIGCONT, so the signal lands at that step every time.
"""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

import pytest

from storage.faults import ENV
from tests.crash import check_store, compare, context, fleet_argv, rerun
from tests.test_crash import ROUNDS

pytestmark = pytest.mark.reliability
STOP_LIMIT_S = 15.0


def wait_stopped(pid: int, exitcode, timeout: float = 240) -> None:
    """Wait until process `pid` halts (SIGSTOP); `exitcode()` is None while it runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "?"
        if state == "T":
            return
        assert exitcode() is None, f"exited {exitcode()} before reaching its stop point"
        time.sleep(0.02)
    raise AssertionError("never reached its stop point")


def stop_at(argv: list[str], log: Path, point: str, signum: int) -> tuple[int, float, str]:
    """Run `cartridges <argv>` until `point`, send `signum`; (exit code, seconds to exit, output)."""
    from tests.crash_child import main

    proc = context().Process(target=main, args=(argv, {ENV: f"{point}:stop"}, str(log)))
    proc.start()
    wait_stopped(proc.pid, lambda: proc.exitcode)
    import os

    os.kill(proc.pid, signum)
    began = time.monotonic()
    os.kill(proc.pid, signal.SIGCONT)
    proc.join(120)
    seconds = time.monotonic() - began
    if proc.is_alive():
        proc.kill()
        raise AssertionError(f"still running {seconds:.0f} s after {signal.Signals(signum).name}")
    return proc.exitcode, seconds, log.read_text(errors="replace")


@pytest.fixture(scope="module")
def clean(tmp_path_factory, tiny_model_dir):
    from tests.crash import run_cli
    from tests.test_fleet_run import write_docs

    root = tmp_path_factory.mktemp("stops")
    docs = write_docs(root / "docs")
    code = run_cli(fleet_argv(tiny_model_dir, docs, root / "clean", ROUNDS), root / "clean.log")
    assert code == 0, (root / "clean.log").read_text()[-3000:]
    return root, docs


# (fault point where the signal lands, signal, the stage the message names)
CASES = [
    ("ingest.shard.0", signal.SIGTERM, "ingest"),
    ("synthesize.questions@2", signal.SIGINT, "fleet_heldout"),
    ("teacher.batch@5", signal.SIGTERM, "fleet_round"),
    ("fleet.round.1", signal.SIGINT, "fleet"),
    ("fleet.index.faiss", signal.SIGTERM, "fleet"),
]


@pytest.mark.parametrize(("point", "signum", "stage"), CASES, ids=[c[0] for c in CASES])
def test_fleet_stops_politely_and_the_rerun_matches(clean, tmp_path, tiny_model_dir, point, signum, stage):
    root, docs = clean
    run = tmp_path / "stopped"
    code, seconds, out = stop_at(fleet_argv(tiny_model_dir, docs, run, ROUNDS), tmp_path / "stop.log", point, signum)
    assert code == 128 + signum, out[-3000:]
    assert seconds < STOP_LIMIT_S
    last = out.strip().splitlines()[-1]
    assert "Traceback" not in out, out[-3000:]
    name = signal.Signals(signum).name
    assert last.startswith(f"stopped by {name} during stage {stage} of `cartridges fleet`: finished work is kept;")
    assert "resume" in last
    if (run / "store" / "catalog.duckdb").exists():
        check_store(run / "store")
    code = rerun(tiny_model_dir, docs, run, ROUNDS)
    assert code == 0, (run / "rerun.log").read_text()[-3000:]
    assert compare(root / "clean", run, ROUNDS) == []
    print(f"{point} {name}: exit {128 + signum} after {seconds:.2f} s: {last}")
    shutil.rmtree(run)


def train_argv(model: Path, corpus: Path, root: Path, *extra: str) -> list[str]:
    return ["train", "--model", str(model), "--corpus", str(corpus), "--preset", "smoke", "--no-filter",
            "--store", str(root / "store"), "--save", str(root / "c.safetensors"), *extra]


def train_results(root: Path) -> tuple:
    from storage import Store
    from tests.crash import safetensors_contents

    store = Store(root / "store", read_only=True)
    conversations = store.table(store.latest("synthesize")).to_pylist()
    targets = store.table(store.latest("teacher")).to_pylist()
    meta, tensors = safetensors_contents(root / "c.safetensors")
    return conversations, targets, tensors


@pytest.mark.parametrize(("point", "signum", "stage", "prefect"), [
    ("synthesize.questions@1", signal.SIGTERM, "synthesize", True),
    ("train.step.1", signal.SIGINT, "train", False),
], ids=["synthesize-prefect-SIGTERM", "train-SIGINT"])
def test_train_stops_politely_and_the_rerun_matches(tmp_path, tiny_model_dir, point, signum, stage, prefect):
    from tests.crash import run_cli
    from tests.test_pipeline import CORPUS

    corpus = tmp_path / "corpus.md"
    corpus.write_text(CORPUS)
    flag = () if prefect else ("--no-prefect",)
    clean_code = run_cli(train_argv(tiny_model_dir, corpus, tmp_path / "clean", "--no-prefect"), tmp_path / "c.log")
    assert clean_code in (0, 3), (tmp_path / "c.log").read_text()[-3000:]  # 3: a tiny model's health check
    code, seconds, out = stop_at(train_argv(tiny_model_dir, corpus, tmp_path / "run", *flag), tmp_path / "stop.log",
                                 point, signum)
    name = signal.Signals(signum).name
    last = out.strip().splitlines()[-1]
    assert code == 128 + signum and seconds < STOP_LIMIT_S, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert last.startswith(f"stopped by {name} during stage {stage} of `cartridges train`: finished work is kept;")
    check_store(tmp_path / "run" / "store")
    code = run_cli(train_argv(tiny_model_dir, corpus, tmp_path / "run", *flag), tmp_path / "rerun.log")
    assert code == clean_code, (tmp_path / "rerun.log").read_text()[-3000:]
    assert train_results(tmp_path / "run") == train_results(tmp_path / "clean")
    print(f"train {point} {name}: exit {128 + signum} after {seconds:.2f} s: {last}")


def test_retrain_stopped_by_sigterm_keeps_the_live_version_and_the_rerun_publishes_the_same(tmp_path, tiny_model_dir):
    from storage.versions import current, version_dirs
    from tests.crash import fleet_state, run_cli
    from tests.test_fleet_run import write_docs

    docs = write_docs(tmp_path / "docs")

    def argv(name: str) -> list[str]:
        return ["retrain", "--docs", str(docs), "--model", str(tiny_model_dir), "--fleet", str(tmp_path / name),
                "--store", str(tmp_path / f"{name}-store"), "--preset", "smoke"]

    assert run_cli(argv("clean"), tmp_path / "clean.log") == 0, (tmp_path / "clean.log").read_text()[-3000:]
    code, seconds, out = stop_at(argv("run"), tmp_path / "stop.log", "fleet.round.1", signal.SIGTERM)
    last = out.strip().splitlines()[-1]
    assert code == 143 and seconds < STOP_LIMIT_S and "Traceback" not in out, out[-3000:]
    assert last.startswith("stopped by SIGTERM during stage fleet of `cartridges retrain`: finished work is kept; "
                           "the live version is unchanged")
    assert current(tmp_path / "run") is None  # nothing half-built was published
    assert run_cli(argv("run"), tmp_path / "rerun.log") == 0, (tmp_path / "rerun.log").read_text()[-3000:]
    assert [v.name for v in version_dirs(tmp_path / "run")] == ["0001"]
    assert fleet_state(current(tmp_path / "run")) == fleet_state(current(tmp_path / "clean"))
    print(f"retrain fleet.round.1 SIGTERM: exit 143 after {seconds:.2f} s: {last}")


def test_eval_stopped_by_sigint_names_the_stage_and_the_rerun_scores_the_same(tmp_path, tiny_model_dir):
    import json
    import subprocess
    import sys

    from cartridges.core.cartridge import init_from_corpus
    from cartridges.core.files import save_cartridge
    from tests.tiny import tiny_llama

    lm = tiny_llama()
    doc = tmp_path / "doc.md"
    doc.write_text("The zebra code is 4417. The lion code is 9021. " * 8)
    qa = tmp_path / "q.jsonl"
    qa.write_text("\n".join(json.dumps({"doc": "doc.md", "question": f"What is code {i}?", "options": ["4417", "9021"],
                                        "answer": i % 2}) for i in range(150)) + "\n")
    cart = save_cartridge(tmp_path / "c.safetensors", init_from_corpus(lm, doc.read_text(), p=16), lm.fingerprint)

    def argv(store: str) -> list[str]:
        return [sys.executable, "-m", "cli.main", "eval", "--qa", str(qa), "--cartridge", str(cart), "--corpus",
                str(doc), "--model", str(tiny_model_dir), "--store", str(tmp_path / store), "--no-peers",
                "--max-new", "4", "--json"]

    def arms(out: str) -> dict:
        result = json.loads(out.strip().splitlines()[-1])
        return {k: (v["accuracy"], round(v["gold_nll"], 6)) for k, v in result["arms"].items()}

    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    clean = subprocess.run(argv("clean"), capture_output=True, text=True, env=env, timeout=300)
    assert clean.returncode == 0, clean.stderr[-3000:]
    # halt after the bare arm's third question, inside its eval_arm stage, and signal there
    proc = subprocess.Popen(argv("run"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**env, ENV: "eval.question.bare@3:stop"})
    wait_stopped(proc.pid, proc.poll)
    proc.send_signal(signal.SIGINT)
    began = time.monotonic()
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=60)
    seconds = time.monotonic() - began
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 130 and seconds < STOP_LIMIT_S and "Traceback" not in err, err[-3000:]
    assert last.startswith("stopped by SIGINT during stage eval_arm of `cartridges eval`: finished work is kept;")
    check_store(tmp_path / "run")
    again = subprocess.run(argv("run"), capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert arms(again.stdout) == arms(clean.stdout)
    print(f"eval SIGINT: exit 130 after {seconds:.2f} s: {last}")
