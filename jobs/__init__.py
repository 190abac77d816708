"""Jobs: runs of several stages, between the flows that schedule them and the stages.

A job opens a run in the catalog, calls its stages in order (each through `call`, which
the Prefect flows replace with "run this as a task"), writes the run's summary and
report, and closes the run; a failure marks the run failed. `pipeline` is the cartridge
job over the stage graph (`stages.graph`), `fleet` the fleet job's steps, `retrain`
publishing new fleet versions, `report` the summaries every job writes. Nothing here
knows about Prefect.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Call = Callable[..., Any]


def plain(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """The default `call`: run the step here."""
    return fn(*args, **kwargs)
