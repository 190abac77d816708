"""One writer per fleet root: an exclusive `flock` on `ROOT/.lock` that names its holder.

The kernel releases a `flock` when its holder exits, however it exits (SIGKILL included),
so a lock left by a dead process never blocks: the file stays, the lock does not. The
holder writes its pid, command line and start time into the file, so a second writer
that finds the root busy can say who holds it. A second writer waits up to `wait_s`
seconds (0: not at all) and then raises `Busy`, one line naming the holder; it has
changed nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from storage.errors import StoreError

LOCK_FILE = ".lock"
POLL_S = 0.2


class Busy(StoreError):
    """Another process holds the root's lock (and kept it for as long as we would wait)."""


def holder(root: Path | str) -> dict | None:
    """What the lock file says about its last holder (None: nothing readable)."""
    try:
        return json.loads((Path(root) / LOCK_FILE).read_text() or "null")
    except (OSError, ValueError):
        return None


def _describe(info: dict | None) -> str:
    if not info:
        return "another process (it has not written its name yet)"
    command = str(info.get("command") or "?")
    command = command if len(command) <= 160 else command[:157] + "..."
    where = "" if info.get("host") in (None, socket.gethostname()) else f" on {info['host']}"
    return f"pid {info.get('pid')}{where} ({info.get('what')}: `{command}`, since {info.get('since')})"


@contextlib.contextmanager
def exclusive(root: Path | str, what: str, wait_s: float = 0.0) -> Iterator[Path]:
    """Hold `root`'s lock for the block; `what` names the job in the holder record."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + max(wait_s, 0.0)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    waited = f" after waiting {wait_s:g} s" if wait_s > 0 else ""
                    raise Busy(f"{root}: busy{waited}: {_describe(holder(root))} is writing it; nothing was "
                               "changed. Rerun when it has finished, or pass --wait SECONDS", root) from None
                time.sleep(POLL_S)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "what": what,
                  "command": " ".join(sys.argv), "since": f"{datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC"}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        try:
            yield path
        finally:
            os.ftruncate(fd, 0)  # released: no stale name left behind for the next message
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def wait_free(root: Path | str, what: str, wait_s: float = 0.0) -> None:
    """Raise `Busy` now (after up to `wait_s` seconds) if another writer holds `root`: a command checks
    this before it starts a run, so a busy root costs no start-up. The run itself takes the lock."""
    if Path(root).is_dir():
        with exclusive(root, what, wait_s):
            pass
