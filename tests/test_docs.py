"""The docs stay true to the code: every command they show parses, every make target exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
CLI_DOC = ROOT / "docs" / "CLI.md"  # generated from the parser; checked whole below
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if p != CLI_DOC)]
BLOCK = re.compile(r"```[a-z]*\n(.*?)```", re.DOTALL)


def commands(path: Path) -> list[str]:
    """Shell lines of a document's code blocks, continuation lines joined, comments dropped."""
    out = []
    for block in BLOCK.findall(path.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line:
                out.append(line)
    return out


def cli_args(line: str) -> list[str] | None:
    """The argument list of a `cartridges` command line, optional-syntax brackets removed."""
    line = re.sub(r"\[([^\[\]|]*)\|[^\[\]]*\]", r"\1", line)  # "[A | B]": alternatives, show A
    words = shlex.split(line.replace("[", " ").replace("]", " "))
    for i, word in enumerate(words):
        if word.endswith("/cartridges") or word == "cartridges":
            args: list[str] = []
            for w in words[i + 1:]:
                if w == "..." and args and args[-1].startswith("--"):
                    args.pop()  # "--corpus ...": the option repeats
                elif w not in ("...", "|"):
                    args.append(w)
            return args
    return None


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))


CASES = [(path.relative_to(ROOT).as_posix(), line) for path in DOCS for line in commands(path)]


@pytest.mark.parametrize(("doc", "line"), [c for c in CASES if cli_args(c[1]) is not None])
def test_documented_cli_commands_parse(doc, line):
    parser = build_parser()
    try:
        parser.parse_args(cli_args(line))
    except SystemExit as e:
        pytest.fail(f"{doc}: `{line}` does not parse (exit {e.code})")


@pytest.mark.parametrize(("doc", "line"), [c for c in CASES if c[1].startswith("make ")])
def test_documented_make_targets_exist(doc, line):
    target = line.split()[1]
    assert target in make_targets(), f"{doc}: `{line}`: no make target {target!r}"


def test_the_docs_show_commands_at_all():
    assert len([c for c in CASES if cli_args(c[1]) is not None]) >= 10


def test_every_table_and_column_is_documented():
    from schemas import TABLES

    text = (ROOT / "docs" / "TABLES.md").read_text()
    for name, schema in TABLES.items():
        assert f"## {name} " in text or f"## {name}\n" in text, f"docs/TABLES.md: no section for {name}"
        section = text.split(f"## {name}", 1)[1].split("\n## ", 1)[0]
        for field in schema:
            assert f"`{field.name}`" in section, f"docs/TABLES.md: {name}.{field.name} undocumented"


def test_the_command_reference_is_generated_from_the_parser():
    from cli.docs import render

    assert CLI_DOC.read_text() == render(), "docs/CLI.md is stale: python -m cli.docs > docs/CLI.md"
