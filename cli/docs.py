"""Render docs/CLI.md from the argument parser, so the reference cannot drift from the code.

Run `python -m cli.docs > docs/CLI.md` after changing a command; a test
compares the file with this output.
"""

from __future__ import annotations

import argparse
import os

from cli.main import build_parser

WIDTH = 100


def render() -> str:
    os.environ["COLUMNS"] = str(WIDTH)  # argparse wraps help text to the terminal width
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in subs._choices_actions}
    lines = ["# Command reference", "",
             "Generated from the parser by `python -m cli.docs`; every command takes",
             "`--debug` (tracebacks), and those that report figures take `--json` (one JSON object",
             "as the last line). User errors print one line `error: ...` and exit 2. A training run",
             "that fails the health check (held-out loss not clearly lower, or a diverging loss",
             "curve; see docs/PIPELINE.md) keeps its cartridge, is recorded failed and exits 3.", ""]
    for name, sub in subs.choices.items():
        sub.prog = f"cartridges {name}"
        lines += [f"## `cartridges {name}`", "", helps.get(name) or "", "", "```", sub.format_help().rstrip(), "```", ""]
        nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]  # `store usage`, ...
        for action in nested:
            inner = {c.dest: c.help for c in action._choices_actions}
            for child_name, child in action.choices.items():
                child.prog = f"cartridges {name} {child_name}"
                lines += [f"### `cartridges {name} {child_name}`", "", inner.get(child_name) or "", "", "```",
                          child.format_help().rstrip(), "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
