"""Named fault-injection points, so crash tests can stop a run at a reproducible place.

`CARTRIDGES_FAULT=<point>` makes the process die at that point: with SIGKILL (as a
real crash would) by default, or by raising `InjectedFault` with `<point>:raise`.
"""

from __future__ import annotations

import os
import signal

ENV = "CARTRIDGES_FAULT"


class InjectedFault(RuntimeError):
    """Raised at a fault point in `raise` mode."""


def fault_point(name: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    point, _, mode = spec.partition(":")
    if point != name:
        return
    if mode == "raise":
        raise InjectedFault(f"injected fault at {name}")
    os.kill(os.getpid(), signal.SIGKILL)
