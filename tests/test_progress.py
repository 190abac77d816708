"""Progress that a log can read: whole lines with done/total, rate and ETA, and a heartbeat
while no update comes; a carriage-return bar only on a terminal."""

from __future__ import annotations

import io
import re
import time

from stages.progress import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_whole_lines_with_done_total_rate_and_eta():
    out = io.StringIO()
    with progress(10, "self-study", "conv", out=out, heartbeat=60) as bar:
        bar.update(4)
        time.sleep(0.05)
        bar.update(6)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0].startswith("self-study: 0/10 conv [")
    last = lines[-1]
    assert last.startswith("self-study: 10/10 conv [")
    assert re.search(r"\d+(\.\d+)?conv/s", last) and "left" in last


def test_a_heartbeat_repeats_the_status_while_no_update_comes():
    out = io.StringIO()
    with progress(8, "teacher", "conv", out=out, heartbeat=0.05) as bar:
        bar.update(2)
        time.sleep(0.6)  # one slow piece of work: about a dozen beats
    beats = [line for line in out.getvalue().splitlines() if line.startswith("teacher: 2/8 conv")]
    assert len(beats) >= 5


def test_no_heartbeat_outlives_its_bar():
    out = io.StringIO()
    with progress(None, "train", "step", out=out, heartbeat=0.02) as bar:
        bar.update(1)
    written = out.getvalue()
    time.sleep(0.1)
    assert out.getvalue() == written and written.splitlines()[-1].startswith("train: 1/? step")


def test_updates_between_beats_print_nothing_and_a_total_learned_late_is_shown():
    out = io.StringIO()
    with progress(None, "train", "step", out=out, heartbeat=60) as bar:
        for step in range(50):
            bar.total = 50
            bar.set_postfix(loss=f"{1 / (step + 1):.4f}", refresh=False)
            bar.update(1)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # the opening status and the closing one: no line per step
    assert lines[-1].startswith("train: 50/50 step [") and "loss=0.0200" in lines[-1]


def test_a_terminal_gets_one_redrawn_bar():
    out = Terminal()
    with progress(5, "self-study", "conv", out=out) as bar:
        bar.update(5)
    drawn = out.getvalue()
    assert "\r" in drawn and "0/5" in drawn and "\n" not in drawn  # redrawn in place, then cleared


def test_resumed_units_fill_the_bar_but_stay_out_of_its_rate_and_time_left():
    out = io.StringIO()
    with progress(100, "self-study", "conv", out=out, heartbeat=60) as bar:
        bar.resume(90)  # an earlier run's shards
        bar.update(5)
        bar.start_t -= 10  # ten seconds for the five conversations this run made
        line = str(bar)
    assert line.startswith("self-study: 95/100 conv [")
    assert "2.00s/conv" in line and "00:10 left" in line  # counted from 5 units, not 95
