"""Question files for evaluation: one JSON object per line, checked line by line.

A line is multiple choice, ``{"question", "options": [...], "answer": index}``, or
free form, ``{"question", "answer": "text"}``; either may name its ``"doc"`` and the
``"region"`` of that document it asks about (a section heading). A bad
line is reported with its number and skipped, so one typo never hides the rest
of a file and never passes silently.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from cartridges.core.errors import CartridgeError


class QAError(CartridgeError):
    """A question file that cannot be used at all (missing, unreadable, no valid line)."""


@dataclass(frozen=True)
class Question:
    line: int
    question: str
    answer: int | str  # option index (multiple choice) or reference text (free form)
    options: tuple[str, ...] = ()
    doc: str | None = None
    region: str | None = None  # the section of `doc` the question is about

    @property
    def multiple_choice(self) -> bool:
        return bool(self.options)


def parse_line(text: str) -> Question | str:
    """A Question, or the reason the line is unusable (without its line number)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg})"
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    question, answer = obj.get("question"), obj.get("answer")
    if not isinstance(question, str) or not question.strip():
        return "'question' must be a non-empty string"
    doc, region = obj.get("doc"), obj.get("region")
    if doc is not None and (not isinstance(doc, str) or not doc.strip()):
        return "'doc' must be a non-empty string when present"
    if region is not None and (not isinstance(region, str) or not region.strip()):
        return "'region' must be a non-empty string when present"
    region = region.strip() if region else None
    options = obj.get("options")
    if options is None:
        if not isinstance(answer, str) or not answer.strip():
            return "free-form 'answer' must be a non-empty string (or give 'options')"
        return Question(0, question.strip(), answer.strip(), (), doc, region)
    if (not isinstance(options, list) or len(options) < 2
            or not all(isinstance(o, str) and o.strip() for o in options)):
        return "'options' must be a list of at least two non-empty strings"
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(options):
        return f"'answer' must be an option index in 0..{len(options) - 1}, got {answer!r}"
    return Question(0, question.strip(), answer, tuple(o.strip() for o in options), doc, region)


def read_questions(path: str | Path) -> tuple[list[Question], list[str]]:
    """Valid questions and one problem line per skipped input line ("FILE:LINE: reason")."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise QAError(f"{path}: no such question file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise QAError(f"{path}: cannot read question file ({e})") from None
    questions, problems = [], []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        parsed = parse_line(text)
        if isinstance(parsed, str):
            problems.append(f"{path}:{number}: {parsed}")
        else:
            questions.append(dataclasses.replace(parsed, line=number))
    if not questions:
        raise QAError(f"{path}: no usable question lines"
                      + (f" ({len(problems)} malformed; first: {problems[0]})" if problems else ""))
    return questions, problems
