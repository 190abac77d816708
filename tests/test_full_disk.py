"""A real full disk: the store and the fleet on a small tmpfs that fills up during a fleet run.

One line naming the file that could not be written, complete artifacts whole, and after the
filesystem grows (space freed) the rerun reaches exactly the uninterrupted run's results.
Needs `mount` (root, or CAP_SYS_ADMIN): skipped with the reason where mounting is not allowed.
"""

from __future__ import annotations

import subprocess

import pytest

from storage.retention import tree_bytes
from tests.crash import check_store, compare, fleet_argv, rerun, run_cli
from tests.test_crash import ROUNDS
from tests.test_fleet_run import write_docs

pytestmark = pytest.mark.reliability


def mount(directory, kib: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(directory)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip() or done.returncode}): "
                    "the full-disk test needs root or CAP_SYS_ADMIN")


@pytest.mark.parametrize("fraction", [0.6, 0.9])
def test_a_fleet_run_on_a_full_filesystem_fails_with_one_line_and_resumes_once_space_is_freed(
        tmp_path, tiny_model_dir, fraction):
    docs = write_docs(tmp_path / "docs")
    code = run_cli(fleet_argv(tiny_model_dir, docs, tmp_path / "clean", ROUNDS), tmp_path / "clean.log")
    assert code == 0, (tmp_path / "clean.log").read_text()[-3000:]
    need = tree_bytes(tmp_path / "clean")
    disk = tmp_path / "disk"
    mount(disk, int(need * fraction) // 1024)
    try:
        code = run_cli(fleet_argv(tiny_model_dir, docs, disk, ROUNDS), tmp_path / "full.log")
        out = (tmp_path / "full.log").read_text(errors="replace")
        last = out.strip().splitlines()[-1]
        assert code == 2 and "Traceback" not in out, out[-3000:]
        assert last.startswith(f"error: [Errno 28] No space left on device: '{disk}/"), last
        assert last.endswith("(disk full: free space and rerun the command; finished work is kept)")
        if (disk / "store" / "catalog.duckdb").exists():
            check_store(disk / "store")
        subprocess.run(["mount", "-o", f"remount,size={4 * need // 1024}k", str(disk)], check=True)  # space freed
        code = rerun(tiny_model_dir, docs, disk, ROUNDS)
        assert code == 0, (disk / "rerun.log").read_text()[-3000:]
        assert compare(tmp_path / "clean", disk, ROUNDS) == []
        print(f"full at {fraction:.0%} of {need} bytes: {last}")
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
