"""Seed prompts for bot A, and the checks that drop degenerate synthetic messages.

A seed fixes only the FORM of bot A's message (a question, a summary request, a
JSON request ...); the sampled chunk is the only content. The prompt format was
chosen by measurement on the 135M default model (DESIGN §11): the chunk inline in
the user turn, then a short instruction, with the assistant turn opened by a label
such as ``Question:``. A system-message chunk with a bare instruction mostly gave
chatter; the inline format with the opened turn gave grounded questions.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from cartridges.core.chat import chat_ids
from schemas.configs import KNOWN_SEED_TYPES


@dataclass(frozen=True)
class Seed:
    """How one seed type asks bot A for a message."""

    type: str
    instruction: str
    assistant_prefix: str
    stop_at_question: bool


# Every seed asks for a question: on the 135M default model, "Request:"-style openings
# produced code, chatter and headings (about half unusable), while the same seed forms
# phrased as "Write one question that ..." with the turn opened by "Question:" gave a
# well-formed, grounded question for 56 of 56 deflate chunks (all seven types).
SEEDS: dict[str, Seed] = {
    s.type: s
    for s in (
        Seed("structuring", "Write one question that asks to list specific facts from this text as a JSON object.",
             "Question:", True),
        Seed("summarization", "Write one question that asks for a short summary of one part of this text.",
             "Question:", True),
        Seed("question", "Write one specific question that this text answers.", "Question:", True),
        Seed("use_case", "Write one practical question that a user could ask and that this text helps to answer.",
             "Question:", True),
        Seed("creative", "Write one question that asks for a short poem or story about a specific detail of this text.",
             "Question:", True),
        Seed("mechanism", "Write one question asking why or how something described in this text works.",
             "Question:", True),
        Seed("verbatim", "Write one question asking for the exact wording or an exact number given in this text.",
             "Question:", True),
        # The fact seeds (not in the default set): each asks for one kind of specific detail, so
        # the conversations rehearse the details a reader is asked about rather than summaries.
        Seed("fact_number", "Write one question whose answer is a specific number, date or amount given in this "
             "text.", "Question:", True),
        Seed("fact_name", "Write one question whose answer is a name or a term given in this text.",
             "Question:", True),
        Seed("fact_condition", "Write one question asking under what condition, or in which case, something "
             "described in this text happens.", "Question:", True),
        Seed("fact_cause", "Write one question asking why something specific in this text happens.",
             "Question:", True),
        Seed("fact_contrast", "Write one question comparing two specific things named in this text.",
             "Question:", True),
    )
}
if tuple(SEEDS) != KNOWN_SEED_TYPES:
    raise RuntimeError(f"seed types {tuple(SEEDS)} do not match the configs' {KNOWN_SEED_TYPES}")

_LABELS = sorted({s.assistant_prefix for s in SEEDS.values()}, key=len, reverse=True)
_LABEL_RE = re.compile(
    r"^\s*(?:(?:" + "|".join(re.escape(label.rstrip(":")) for label in _LABELS) + r")\s*:\s*)+",
    re.IGNORECASE,
)
_QUOTES = "\"'“”‘’`"
_WORD = re.compile(r"[\w']+")

# First words that make a message without '?' read as a request to an assistant.
REQUEST_WORDS = frozenset({
    "write", "list", "explain", "describe", "summarize", "summarise", "give", "create",
    "compose", "provide", "outline", "compare", "what", "how", "why", "which", "who", "when",
    "where", "tell", "show", "generate", "draft", "extract", "organize", "organise", "format",
    "convert", "put", "make", "help", "name", "identify", "define", "quote", "state", "find",
    "imagine", "suggest", "rewrite", "translate", "can", "could", "would", "is", "are",
    "does", "do", "i'd",
})
_POLITE = ("please",)
FOCUS_LEAD = "Ask about this sentence of the text:"


def seed(seed_type: str) -> Seed:
    """The Seed for ``seed_type``; an unknown type is a ValueError naming the known ones."""
    try:
        return SEEDS[seed_type]
    except KeyError:
        raise ValueError(
            f"unknown seed type {seed_type!r}; choose from {', '.join(SEEDS)}"
        ) from None


def bot_a_prompt(tokenizer, chunk_text: str, seed_type: str, focus: str | None = None) -> list[int]:
    """Token ids of bot A's prompt: chunk and instruction in one user turn, assistant turn opened.

    No system message is given, so a template such as SmolLM2's inserts its default
    system prompt. That is harmless here: bot A's tokens are never supervised, and
    the student/teacher sequences are built elsewhere without that prompt.
    A `focus` sentence (synthesis' `focus` lever) is quoted before the instruction,
    so the question is about that fact of the chunk rather than whichever bot A picks.
    The label is tokenized without a trailing space so the model's next token
    carries its own leading space (" What ..."), as in ordinary text.
    """
    s = seed(seed_type)
    ask = f"{FOCUS_LEAD} {focus}\n{s.instruction}" if focus else s.instruction
    messages = [{"role": "user", "content": f"{chunk_text}\n\n{ask}"}]
    ids = chat_ids(tokenizer, messages, add_generation_prompt=True)
    label = tokenizer(s.assistant_prefix.rstrip(), add_special_tokens=False)["input_ids"]
    return ids + [int(t) for t in label]


def stops_at_question(seed_type: str, lever: bool = True) -> bool:
    """Whether bot A's message for ``seed_type`` ends at its first '?' (``lever``: the config's switch)."""
    return lever and seed(seed_type).stop_at_question


def clean_question(text: str, seed_type: str, stop_at_question: bool = True) -> str:
    """Bot A's continuation as the user message bot B will see.

    Drops repeated labels ("Question: Question: ..."), keeps everything up to and
    including the first '?' for question-like seeds (unless ``stop_at_question`` is
    off, the lever that lets bot A run on), then keeps the first line
    (a user message is one line; what follows is usually bot A answering itself)
    and strips wrapping quotes.
    """
    out = _LABEL_RE.sub("", text.strip())
    if stops_at_question(seed_type, stop_at_question) and "?" in out:
        out = out[: out.index("?") + 1]
    out = out.strip().split("\n", 1)[0].strip()
    if out[:1] in _QUOTES:
        out = out[1:]
    if out[-1:] in _QUOTES:
        out = out[:-1]
    return out.strip()


def _words(text: str) -> list[str]:
    return [w.strip("'") for w in _WORD.findall(text.lower()) if w.strip("'")]


def _ngram_loop(words: list[str], n: int, times: int = 3) -> bool:
    grams = Counter(tuple(words[i: i + n]) for i in range(len(words) - n + 1))
    return bool(grams) and max(grams.values()) >= times


def _dominated(words: list[str], share: float = 0.4, min_count: int = 3) -> bool:
    if not words:
        return False
    _, count = Counter(words).most_common(1)[0]
    return count >= min_count and count / len(words) > share


def score_message(text: str, instruction: str) -> tuple[bool, str]:
    """(ok, reason) for a cleaned bot A message; reason is "" when ok.

    Checked in order:
    - ``empty``: nothing but whitespace;
    - ``too_short``: fewer than 4 words;
    - ``repetitive``: a word 3-gram occurs 3+ times, or one word is over 40% of
      the words (and occurs at least 3 times);
    - ``echo``: over 70% of its words occur in the instruction (bot A parroted it);
    - ``not_request``: no '?' and the first word (after "please") is not one of
      REQUEST_WORDS, i.e. it reads as chatter rather than something asked of an
      assistant. Whether question seeds must end in '?' is the caller's rule.
    """
    if not text.strip():
        return False, "empty"
    words = _words(text)
    if len(words) < 4:
        return False, "too_short"
    if _ngram_loop(words, 3) or _dominated(words):
        return False, "repetitive"
    told = set(_words(instruction))
    if sum(w in told for w in words) / len(words) > 0.7:
        return False, "echo"
    if "?" not in text:
        first = [w for w in words if w not in _POLITE][:1]
        if not first or first[0] not in REQUEST_WORDS:
            return False, "not_request"
    return True, ""


def _strip_occurrences(words: list[str], part: list[str]) -> list[str]:
    """``words`` with every contiguous occurrence of ``part`` removed."""
    if not part:
        return words
    out: list[str] = []
    i, n = 0, len(part)
    while i < len(words):
        if words[i: i + n] == part:
            i += n
        else:
            out.append(words[i])
            i += 1
    return out


def score_answer(text: str, question: str) -> tuple[bool, str]:
    """(ok, reason) for bot B's answer; reason is "" when ok.

    - ``empty``: nothing but whitespace;
    - ``repetitive``: a word 5-gram occurs 3+ times (a decoding loop; shorter
      n-grams recur in honest lists), or one word is over 40% of 10+ words;
    - ``copy``: the answer is the question, repeats it adding fewer than 3 words,
      or (4+ words) uses only words of the question.
    """
    if not text.strip():
        return False, "empty"
    words = _words(text)
    if _ngram_loop(words, 5) or (len(words) >= 10 and _dominated(words)):
        return False, "repetitive"
    q = _words(question)
    if q:
        if words == q or len(_strip_occurrences(words, q)) < 3 <= len(words):
            return False, "copy"
        if len(words) >= 4 and set(words) <= set(q):
            return False, "copy"
    return True, ""
