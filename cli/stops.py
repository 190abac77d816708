"""Polite stops: SIGINT (Ctrl-C) and SIGTERM end a long command within seconds, with one line.

While `train`, `fleet`, `retrain`, `eval` or `stage` runs, both signals raise `Stopped` (a
`KeyboardInterrupt`) in the main thread at the next Python step: the work in flight is
abandoned, every stage it interrupts is recorded failed with its finished shards kept (the
store's usual path for an error), and `main` prints one line naming the stage and how to
resume, then exits 128 + the signal (130 for SIGINT, 143 for SIGTERM). A second signal
while stopping ends the process at once (the default action).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
from collections.abc import Iterator
from pathlib import Path

from cli.options import dest

LONG_COMMANDS = ("train", "fleet", "retrain", "eval", "stage")
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(KeyboardInterrupt):
    """A stop signal arrived; `signum` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum: int, _frame) -> None:
    for s in SIGNALS:  # a second signal: no more politeness
        signal.signal(s, signal.SIG_DFL)
    raise Stopped(signum)


@contextlib.contextmanager
def polite_stops(command: str) -> Iterator[None]:
    """Turn SIGINT and SIGTERM into `Stopped` for the block (long commands only; main thread only)."""
    if command not in LONG_COMMANDS:
        yield
        return
    try:
        old = {s: signal.signal(s, _raise) for s in SIGNALS}
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def exit_code(exc: KeyboardInterrupt) -> int:
    return 128 + getattr(exc, "signum", signal.SIGINT)


def _stage(exc: BaseException) -> str | None:
    from storage.faults import last_point

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:  # the stage may sit on a wrapped exception
        seen.add(id(exc))
        if getattr(exc, "stage", None):
            return exc.stage
        exc = exc.__context__ or exc.__cause__
    point = last_point()
    return point.split(".")[0] if point else None


def _fleet_rounds(directory: str | None) -> int | None:
    try:
        return int(json.loads((Path(directory) / "fleet.json").read_text())["rounds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def stop_message(args: argparse.Namespace, exc: KeyboardInterrupt, rounds_before: int | None = None) -> str:
    """One line: which signal, which stage, what was kept, how to resume."""
    name = signal.Signals(exit_code(exc) - 128).name
    stage = _stage(exc)
    where = f"during stage {stage} of" if stage else "during"
    command = getattr(args, "command", "?")
    if command == "fleet":
        done = _fleet_rounds(args.fleet)
        if done is None:
            how = "rerun the same command to resume"
        else:
            rounds = getattr(args, dest("--rounds"))
            wanted = (rounds_before or 0) + (rounds if rounds is not None else 0)
            missing = f" --rounds {max(wanted - done, 0)}" if rounds is not None else ""
            how = f"rerun with --resume{missing} to resume (the fleet has {done} rounds)"
    elif command == "retrain":
        how = "the live version is unchanged; rerun the same command to resume"
    else:
        how = "rerun the same command to resume"
    return f"stopped by {name} {where} `cartridges {command}`: finished work is kept; {how}"


def rounds_now(args: argparse.Namespace) -> int | None:
    """A fleet's rounds before the command runs (for the resume hint)."""
    return _fleet_rounds(getattr(args, "fleet", None)) if getattr(args, "command", None) == "fleet" else None
