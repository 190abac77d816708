"""Prompt-lookup drafts for speculative greedy decoding, with a per-stream acceptance gate.

A stream that answers from text it can see (bot B and its chunk, a served answer and
the cartridge's corpus) often continues a span it has already seen: the tokens that
followed the latest earlier occurrence of its last n tokens are a free guess at what
comes next. The batch verifies every guess in the step it would have taken anyway and
keeps only what greedy decoding would have chosen, so output does not change; what a
draft costs is the extra query tokens, which pay only when enough are accepted.
"""

from __future__ import annotations

from collections.abc import Sequence

NGRAMS = (3, 2)  # longest match first; one-token matches guess too often to pay
WINDOW = 16  # drafted tokens the gate looks back over
MIN_ACCEPT = 0.35  # below this share accepted, drafting stops for the stream
REPROBE = 32  # tokens generated without drafts before the stream drafts again


class Drafter:
    """An n-gram index over a stream's reference, prompt and own tokens."""

    def __init__(self, reference: Sequence[int], prompt: Sequence[int], width: int) -> None:
        self.width = width
        self.seq: list[int] = []
        # n-gram -> position just after its latest occurrence, for n-grams that have a next
        # token: the stream's own tail is registered only once the token after it exists.
        self.index: dict[tuple[int, ...], int] = {}
        self.outcomes: list[tuple[int, int]] = []  # (drafted, accepted) per verified draft
        self.paused_at: int | None = None
        self.extend(list(reference))
        self.extend(list(prompt))

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.seq.append(int(t))
            last = len(self.seq) - 1  # the n-grams ending here now have a next token
            for n in NGRAMS:
                if last >= n:
                    self.index[tuple(self.seq[last - n : last])] = last

    def propose(self, generated: int) -> list[int]:
        """Up to `width` tokens that followed an earlier occurrence of the current tail (or none)."""
        if self.paused_at is not None:
            if generated - self.paused_at < REPROBE:
                return []
            self.paused_at, self.outcomes = None, []
        end = len(self.seq)
        for n in NGRAMS:
            at = self.index.get(tuple(self.seq[end - n :])) if end >= n else None
            if at is not None:
                return self.seq[at : at + self.width]
        return []

    def record(self, drafted: int, accepted: int, generated: int) -> None:
        """Feed the gate: drafting pauses while the recent acceptance rate is below MIN_ACCEPT."""
        if not drafted:
            return
        self.outcomes.append((drafted, accepted))
        total = 0
        kept = []
        for d, a in reversed(self.outcomes):
            kept.append((d, a))
            total += d
            if total >= WINDOW:
                break
        self.outcomes = kept[::-1]
        if total >= WINDOW and sum(a for _, a in kept) < MIN_ACCEPT * total:
            self.paused_at = generated
