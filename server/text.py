"""Token ids to text as they arrive: whole characters only, cut at the first stop string."""

from __future__ import annotations


class TextStream:
    """Feed token ids; get back the text that is safe to send.

    Text is held back while it ends in an unfinished UTF-8 sequence or could still be the
    start of a stop string; once a stop string appears the text ends just before it.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip: tuple[int, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip = set(skip)
        self.ids: list[int] = []
        self.sent = 0  # characters already returned
        self.stopped = False

    def feed(self, token: int) -> str:
        if self.stopped:
            return ""
        if token not in self.skip:
            self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            return self._emit(text[:cut])
        if text.endswith("\ufffd"):
            return ""
        return self._emit(text[: len(text) - self._held(text)])

    def flush(self) -> str:
        """The rest of the text once the stream ended without a stop string."""
        if self.stopped:
            return ""
        return self._emit(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _emit(self, upto: str) -> str:
        delta = upto[self.sent:]
        self.sent = max(self.sent, len(upto))
        return delta

    def _stop_at(self, text: str) -> int | None:
        start = max(0, self.sent - max((len(s) for s in self.stop), default=0))
        hits = [i for s in self.stop if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _held(self, text: str) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
