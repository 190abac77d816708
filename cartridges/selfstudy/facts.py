"""Fact coverage: which sentences of a document some training conversation is grounded in.

Token coverage says every span of text was in some chunk; it does not say that any
question asked about what a sentence states. This measures that, by word overlap:

- a document is split into sentences: Markdown blocks (paragraphs, list items,
  table rows, quotes; headings are titles, not facts, and are left out) and, inside
  a block, at ``.``, ``!`` or ``?`` followed by white space (a list item's marker,
  such as ``1.``, stays with its first sentence);
- a sentence's content words are its distinct lowercased words (runs of letters
  and digits) that are numbers or at least two characters long and not stop words;
- a sentence is grounded in a conversation (its question and answer together,
  about the same document) when they share at least ``needed(words)`` of its
  content words: ``MIN_SHARED`` (3), or ``SHARE`` (half) of them when that is more,
  or all of them when the sentence has fewer than ``MIN_SHARED``.

Sentences without content words (a bare ``---``) are not listed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

MIN_SHARED = 3
SHARE = 0.5

STOP_WORDS = frozenset("""
a about above after again against all also am an and any are as at be because been before being
below between both but by can could did do does doing down during each either else etc few for
from further had has have having he her here hers herself him himself his how however i if in
into is it its itself just let like may me might more most must my myself no nor not now of off
on once one only or other our ours ourselves out over own per same she should so some such than
that the their theirs them themselves then there these they this those through thus to too under
until up upon us use used uses using very via was we were what when where whether which while
who whom whose why will with within without would yes yet you your yours yourself yourselves
""".split())

_WORD = re.compile(r"[^\W_]+")
_BLOCK_START = re.compile(r"^(#{1,6}\s|[-*+]\s|\d+[.)]\s|\||>)")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_MARKER = re.compile(r"^(\d+[.)]|[-*+])\s+")


def content_words(text: str) -> frozenset[str]:
    """Distinct lowercased words that carry content: numbers, and non-stop words of 2+ characters."""
    return frozenset(w for w in _WORD.findall(text.lower())
                     if w.isdigit() or (len(w) >= 2 and w not in STOP_WORDS))


def _blocks(text: str) -> list[str]:
    """Paragraphs and Markdown items, wrapped lines joined; a heading or table row stands alone."""
    blocks: list[list[str]] = []
    open_block = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            open_block = False
            continue
        if not open_block or _BLOCK_START.match(line):
            blocks.append([])
        blocks[-1].append(line)
        open_block = not line.startswith(("#", "|"))
    return [" ".join(b) for b in blocks]


def _split(block: str) -> list[str]:
    """A block's sentences, its list marker (if any) kept on the first."""
    marker = _MARKER.match(block)
    head = marker.group(0) if marker else ""
    parts = _SENTENCE_END.split(block[len(head):])
    return [head + parts[0], *parts[1:]]


def sentences(text: str) -> list[str]:
    """The document's sentences in order (headings left out), each with at least one content word."""
    return [s for block in _blocks(text) if not block.startswith("#")
            for s in _split(block) if content_words(s)]


def needed(words: int) -> int:
    """Shared content words that ground a sentence with ``words`` of them."""
    return min(words, max(MIN_SHARED, math.ceil(SHARE * words)))


def grounded(sentence: frozenset[str], conversation: frozenset[str]) -> bool:
    """Whether a conversation's content words ground a sentence's (see the module's rule)."""
    return len(sentence & conversation) >= needed(len(sentence))


def grounding_counts(text: str, conversations: Iterable[str]) -> list[tuple[str, int, int]]:
    """(sentence, content words, conversations grounded in it) for each sentence of ``text``."""
    convs = [content_words(c) for c in conversations]
    out = []
    for s in sentences(text):
        words = content_words(s)
        out.append((s, len(words), sum(grounded(words, c) for c in convs)))
    return out


def focus_sentence(chunk_text: str, turn: int) -> str | None:
    """The sentence of a chunk that conversation `turn` about it asks about (None: no sentence).

    A chunk's first and last sentences are usually cut by its token boundaries, so they are
    skipped when whole ones remain; consecutive turns take consecutive sentences, so the
    conversations about one span ask about different facts of it."""
    found = sentences(chunk_text)
    whole = found[1:-1] if len(found) > 2 else found
    return whole[turn % len(whole)] if whole else None
