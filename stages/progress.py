"""Progress of long stages: a tqdm bar on a terminal, plain dated lines in a log.

In a file or a pipe (CI, `nohup`, `make demo > log`) a carriage-return bar is
unreadable, and a stage whose updates come minutes apart would print nothing for
minutes. There the same tqdm status (done/total, rate, ETA) is written as whole
lines, and a heartbeat repeats it every `HEARTBEAT_S` seconds while no update comes.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import IO

from tqdm import tqdm

HEARTBEAT_S = 30.0
# One format whether or not the total is known yet (training learns it at its first step: "?").
LOG_FORMAT = "{desc}: {n_fmt}/{total_fmt} {unit} [{elapsed} elapsed, {remaining} left, {rate_fmt}{postfix}]"


class Bar(tqdm):
    def resume(self, n: int) -> None:
        """Count `n` units that an earlier run finished: they fill the bar but stay out of its
        rate and time left (tqdm's `initial`), which would otherwise promise a resumed stage
        the end in seconds."""
        self.initial += n
        self.n += n
        self.last_print_n += n
        self.refresh()


class _Lines:
    """A stream for tqdm that turns each status redraw into its own line."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out

    def write(self, text: str) -> int:
        line = text.replace("\r", "").rstrip()
        if line:
            self.out.write(line + "\n")
            self.out.flush()
        return len(text)

    def flush(self) -> None:
        self.out.flush()


@contextlib.contextmanager
def progress(total: int | None, desc: str, unit: str, out: IO[str] | None = None,
             heartbeat: float = HEARTBEAT_S) -> Iterator[Bar]:
    """A bar for `total` units of work (None when unknown); `.update(n)` as units finish."""
    out = out or sys.stderr
    if out.isatty():
        with Bar(total=total, desc=desc, unit=unit, file=out, leave=False) as bar:
            yield bar
        return
    bar = Bar(total=total, desc=desc, unit=unit, file=_Lines(out), mininterval=heartbeat,
               bar_format=LOG_FORMAT, dynamic_ncols=False)
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(heartbeat):
            bar.refresh()

    beater = threading.Thread(target=beat, name=f"progress-{desc}", daemon=True)
    beater.start()
    try:
        yield bar
    finally:
        stop.set()
        beater.join()
        bar.close()  # the final status as the last line
