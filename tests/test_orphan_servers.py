"""Temporary Prefect servers left by killed runs: the next flow command stops them, and only them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from flows.ephemeral import OWNER_ENV, SERVER_MODULE, orphaned_servers, reap_orphans

REPO = Path(__file__).resolve().parent.parent

CHILD = """
import time
from prefect import flow
from flows.ephemeral import server_errors

@flow
def noop():
    return 1

with server_errors():
    noop()
    print("ran", flush=True)
    time.sleep(600)
"""


def fake_process(proc: Path, pid: int, cmdline: bytes, environ: dict[str, str], parent: int) -> None:
    entry = proc / str(pid)
    entry.mkdir(parents=True)
    (entry / "cmdline").write_bytes(cmdline)
    (entry / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in environ.items()))
    (entry / "stat").write_text(f"{pid} (python3 x) S {parent} {pid} {pid} 0 -1")


def test_only_servers_whose_cartridges_owner_is_gone_are_orphans(tmp_path):
    server = b"python3\0-m\0uvicorn\0--factory\0" + SERVER_MODULE + b"\0"
    fake_process(tmp_path, 10, server, {OWNER_ENV: "5", "PATH": "/bin"}, parent=1)  # owner died: orphan
    fake_process(tmp_path, 11, server, {OWNER_ENV: "6"}, parent=6)  # owner alive and its parent
    fake_process(tmp_path, 12, server, {"PATH": "/bin"}, parent=1)  # another program's server
    fake_process(tmp_path, 13, b"python3\0train.py\0", {OWNER_ENV: "5"}, parent=1)  # not a server
    (tmp_path / "self").mkdir()
    assert orphaned_servers(tmp_path) == [10]


def server_of(owner: int, timeout: float = 120) -> int:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if (SERVER_MODULE in (entry / "cmdline").read_bytes()
                            and f"{OWNER_ENV}={owner}".encode() in (entry / "environ").read_bytes().split(b"\0")):
                        return int(entry.name)
                except OSError:
                    continue
        time.sleep(0.2)
    raise AssertionError(f"no temporary server of {owner}")


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_a_killed_runs_temporary_server_is_stopped_by_the_next_command(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != OWNER_ENV}
    env.update(PREFECT_HOME=str(tmp_path / "home"), PYTHONPATH=str(REPO))
    child = subprocess.Popen([sys.executable, "-c", CHILD], env=env, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ran"
        server = server_of(child.pid)
        assert server not in orphaned_servers()  # its owner is alive: not touched
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        assert server in orphaned_servers()
        assert server in reap_orphans()
        start = time.monotonic()
        while not gone(server):
            assert time.monotonic() - start < 30, "the orphaned server did not stop"
            time.sleep(0.1)
    finally:
        child.kill()
