"""Two writers on one fleet root, as two real processes: one proceeds, the other waits or exits with
one line naming the holder; a holder that dies never blocks; no version is ever a mix.

A writer is held still with SIGSTOP while it holds the lock, so the second one meets it there
every time (no race on timing); SIGCONT lets it finish, SIGKILL plays the crash.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cartridges.fleet.manifest import read_manifest
from storage.lock import LOCK_FILE, holder
from storage.versions import current, version_dirs
from tests.test_fleet_run import write_docs

pytestmark = pytest.mark.reliability
REPO = Path(__file__).resolve().parents[1]


def start(argv: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out = open(log, "wb")  # noqa: SIM115  (closed when the process is reaped, below)
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", *argv], stdout=out, stderr=subprocess.STDOUT,
                            env=env, cwd=REPO, start_new_session=True)
    proc.log = log  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    code = proc.wait(timeout)
    return code, proc.log.read_text(errors="replace")  # type: ignore[attr-defined]


def hold_still(proc: subprocess.Popen, root: Path, timeout: float = 120) -> dict:
    """SIGSTOP `proc` as soon as its name is in the root's lock file; returns the holder record."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = holder(root)
        if info and info.get("pid") == proc.pid:
            os.kill(proc.pid, signal.SIGSTOP)
            return info
        assert proc.poll() is None, proc.log.read_text()[-3000:]  # type: ignore[attr-defined]
        time.sleep(0.02)
    raise AssertionError(f"pid {proc.pid} never took the lock of {root}")


def fleet(model, docs, root, store, rounds, *extra):
    return ["fleet", "--docs", str(docs), "--model", str(model), "--fleet", str(root), "--store", str(store),
            "--preset", "smoke", "--rounds", str(rounds), "--no-prefect", *extra]


def test_second_fleet_run_exits_naming_the_holder_or_waits_for_it(tmp_path, tiny_model_dir):
    docs, root = write_docs(tmp_path / "docs"), tmp_path / "fleet"
    code, out = finish(start(fleet(tiny_model_dir, docs, root, tmp_path / "s0", 1), tmp_path / "build.log"))
    assert code == 0, out[-3000:]

    first = start(fleet(tiny_model_dir, docs, root, tmp_path / "s1", 3, "--resume"), tmp_path / "first.log")
    info = hold_still(first, root)
    try:
        began = time.monotonic()
        code, out = finish(start(fleet(tiny_model_dir, docs, root, tmp_path / "s2", 1, "--resume"),
                                 tmp_path / "second.log"))
        assert code == 2 and time.monotonic() - began < 60
        line = out.strip().splitlines()[-1]
        assert "Traceback" not in out and line.startswith(f"error: {root}: busy: pid {first.pid} ")
        assert "fleet" in line and info["since"] in line and "--wait SECONDS" in line
        waiting = start(fleet(tiny_model_dir, docs, root, tmp_path / "s3", 1, "--resume", "--wait", "120"),
                        tmp_path / "waiting.log")
        time.sleep(6)  # long enough to import, load and reach the lock
        assert waiting.poll() is None  # it waits
    finally:
        os.kill(first.pid, signal.SIGCONT)
    code, out = finish(first)
    assert code == 0, out[-3000:]
    code, out = finish(waiting)
    assert code == 0, out[-3000:]
    assert read_manifest(root).rounds == 1 + 3 + 1  # both ran, one after the other; the refused one added none
    assert (root / LOCK_FILE).read_text() == ""  # released: no stale holder left behind


def test_a_killed_holder_never_blocks_and_no_mixed_version_is_published(tmp_path, tiny_model_dir):
    docs, root = write_docs(tmp_path / "docs"), tmp_path / "root"

    def retrain(store: str, *extra: str) -> list[str]:
        return ["retrain", "--docs", str(docs), "--model", str(tiny_model_dir), "--fleet", str(root),
                "--store", str(tmp_path / store), "--preset", "smoke", *extra]

    first = start(retrain("s1"), tmp_path / "first.log")
    hold_still(first, root)
    try:
        code, out = finish(start(retrain("s2"), tmp_path / "second.log"))
        assert code == 2, out[-3000:]
        line = out.strip().splitlines()[-1]
        assert "Traceback" not in out and line.startswith(f"error: {root}: busy: pid {first.pid} (retrain: ")
    finally:
        os.kill(first.pid, signal.SIGKILL)  # the holder dies, lock and all
        first.wait()
    assert current(root) is None  # it published nothing

    code, out = finish(start(retrain("s3"), tmp_path / "third.log"))
    assert code == 0, out[-3000:]
    assert [p.name for p in version_dirs(root)] == ["0001"] and current(root) == version_dirs(root)[0].resolve()
    manifest = read_manifest(current(root))
    assert sorted(d.name for d in manifest.documents) == ["d0.md", "d1.md", "d2.md"]
    for d in manifest.documents:  # every file the manifest names is there (no half-built leftovers)
        assert (current(root) / d.cartridge).is_file() and (current(root) / d.optimizer).is_file()
    assert json.loads((current(root) / "fleet.json").read_text())["rounds"] == manifest.rounds
