"""Named fault-injection points, so crash tests can stop a run at a reproducible place.

`CARTRIDGES_FAULT=<point>[@<n>][:<mode>]` makes the process fail at that point:

- `<point>` is a point name, or a shell-style pattern over names (`fleet.round.*`);
- `@<n>` fires on the n-th time a matching point is reached in this process (default 1);
- `<mode>` is `kill` (the default: SIGKILL, as a real crash would), `raise` (raise
  `InjectedFault`), `enospc` (raise `OSError(ENOSPC)`, a full disk), or `stop` (SIGSTOP:
  the process halts there until SIGCONT, so a test can signal it at a known place), or
  `fill` (fill the filesystem that holds the file `$CARTRIDGES_FAULT_FILL` until it is full,
  then go on: the run's next real write meets a real full disk), or `wait` (once across
  processes: write the pid to the file `$CARTRIDGES_FAULT_WAIT` and sleep there until a
  signal ends the wait, so a test can stop a run it does not own, such as a Prefect flow run,
  at a known place; a process that finds the file already there goes on).

`last_point()` is the newest point this process passed (a stopped run names its step).

`fault_points()` lists the points a run passes (`CARTRIDGES_FAULT_TRACE=<file>` appends
each name reached to that file), which is how crash tests enumerate where to kill.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import signal
import time

ENV = "CARTRIDGES_FAULT"
TRACE_ENV = "CARTRIDGES_FAULT_TRACE"
FILL_ENV = "CARTRIDGES_FAULT_FILL"
WAIT_ENV = "CARTRIDGES_FAULT_WAIT"
MODES = ("kill", "raise", "enospc", "stop", "fill", "wait")

_hits: dict[str, int] = {}
_last: list[str] = []


def last_point() -> str | None:
    return _last[0] if _last else None


class InjectedFault(RuntimeError):
    """Raised at a fault point in `raise` mode."""


def parse(spec: str) -> tuple[str, int, str]:
    """(pattern, n, mode) of a `CARTRIDGES_FAULT` value."""
    point, _, mode = spec.partition(":")
    pattern, _, nth = point.partition("@")
    mode = mode or "kill"
    if mode not in MODES:
        raise ValueError(f"{ENV}={spec!r}: unknown mode {mode!r} (one of {', '.join(MODES)})")
    try:
        n = int(nth) if nth else 1
    except ValueError as exc:
        raise ValueError(f"{ENV}={spec!r}: '@{nth}' is not a count") from exc
    return pattern, n, mode


def fault_point(name: str) -> None:
    _last[:] = [name]
    trace = os.environ.get(TRACE_ENV)
    if trace:
        with open(trace, "a", encoding="utf-8") as f:
            f.write(name + "\n")
    spec = os.environ.get(ENV)
    if not spec:
        return
    pattern, n, mode = parse(spec)
    if name != pattern and not fnmatch.fnmatchcase(name, pattern):
        return
    _hits[spec] = _hits.get(spec, 0) + 1
    if _hits[spec] != n:
        return
    if mode == "raise":
        raise InjectedFault(f"injected fault at {name}")
    if mode == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {name})")
    if mode == "fill":
        fill_disk(os.environ[FILL_ENV])
        return
    if mode == "wait":
        wait_for_signal(os.environ[WAIT_ENV])
        return
    os.kill(os.getpid(), signal.SIGSTOP if mode == "stop" else signal.SIGKILL)


def wait_for_signal(marker: str) -> None:
    """Sleep until a signal handler raises, unless another process has waited on `marker` already."""
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(0.05)


def fill_disk(path: str, block: int = 1 << 16) -> int:
    """Append zeros to `path` until its filesystem is full; returns the bytes written."""
    written = 0
    zeros = bytes(block)
    with open(path, "ab", buffering=0) as f:
        while True:
            try:
                written += f.write(zeros)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if block == 1:
                    return written
                block //= 16
                zeros = bytes(block)
