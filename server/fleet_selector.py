"""Fleet mode: each conversation sits behind the documents retrieved for it, and keeps its KV.

A conversation is named by its opening: the system turn(s) before the first user message
and that message (a hash of them). Its first turn retrieves `rag_docs` documents with the
fleet's index on the first user message and composes their cartridges best first (the
order `fleet.select` returns and `cartridges ask --fleet` uses). Follow-up turns keep the
conversation's selection. With `adaptive`, every follow-up also retrieves with its newest
user message, and the selection switches (to the top documents for that message) only when
a document outside it scores more than `margin` above every selected one.

When a turn finishes, its rows (cartridges, then the KV of its prompt and answer) are kept
for the conversation in a bounded LRU (entries and total rows). A later request of the
conversation sits behind the longest run of those rows whose tokens its rendered prompt
starts with, and prefills only the rest (reported as cached tokens). The KV is causal, so
a prefix of it is exactly the KV of that token prefix: a follow-up normally reuses the
whole previous turn; where the client's copy of the answer retokenizes differently (or
was edited) reuse stops at the first differing token; a switched selection starts over.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from cartridges.core.errors import CartridgeError
from cartridges.core.models import LoadedModel
from cartridges.core.prefix import Rows, prefix_length
from cartridges.core.sharing import common_length
from cartridges.fleet.api import Fleet
from cartridges.fleet.manifest import MANIFEST
from server.errors import bad_request, internal
from server.selector import Selection, render_prompt
from storage.versions import is_versioned

COMPOSED_CACHE = 32  # compositions (tuples of documents) whose rows are kept composed


def identity(messages: list[dict]) -> str | None:
    """The conversation's key: system turns before the first user message, and that message."""
    opening = []
    for m in messages:
        if m["role"] == "user":
            opening.append(["user", m["content"]])
            return hashlib.sha256(json.dumps(opening).encode()).hexdigest()
        if m["role"] == "system":
            opening.append(["system", m["content"]])
    return None


def user_messages(messages: list[dict]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "user"]


@dataclass
class Conversation:
    names: tuple[str, ...]  # the documents it sits behind, in composition order
    ids: list[int] = field(default_factory=list)  # conversation tokens whose KV `kv` holds after the cartridges
    kv: Rows | None = None  # cartridge rows + KV of `ids` (None until a turn finished)

    @property
    def rows(self) -> int:
        return prefix_length(self.kv) if self.kv else 0

    def reuse(self, n: int) -> Rows:
        """The cartridge rows and the KV of the first `n` conversation tokens."""
        assert self.kv is not None and 0 < n <= len(self.ids)
        if n == len(self.ids):
            return self.kv
        end = self.rows - len(self.ids) + n
        return [(k[:, :end], v[:, :end]) for k, v in self.kv]


class Conversations:
    """Least recently used conversations, capped in entries and in total KV rows."""

    def __init__(self, max_entries: int, max_rows: int) -> None:
        self.max_entries, self.max_rows = max_entries, max_rows
        self._items: OrderedDict[str, Conversation] = OrderedDict()
        self.rows = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def keys(self) -> list[str]:
        return list(self._items)

    def get(self, key: str) -> Conversation | None:
        conv = self._items.get(key)
        if conv is not None:
            self._items.move_to_end(key)
        return conv

    def put(self, key: str, conv: Conversation) -> None:
        if conv.rows > self.max_rows:  # too long to keep: remember the selection only
            conv = Conversation(conv.names)
        old = self._items.pop(key, None)
        if old is not None:
            self.rows -= old.rows
        self._items[key] = conv
        self.rows += conv.rows
        while len(self._items) > self.max_entries or self.rows > self.max_rows:
            _, gone = self._items.popitem(last=False)
            self.rows -= gone.rows
            self.evicted += 1

    def clear(self) -> None:
        self._items.clear()
        self.rows = 0


@dataclass
class _Opened:
    fleet: Fleet
    version: int
    loaded_at: float
    fleet_version: str | None  # the published version read (`versions/NNNN`); None for a plain fleet directory
    conversations: Conversations
    composed: OrderedDict[tuple[str, ...], Rows] = field(default_factory=OrderedDict)


class FleetSelector:
    """Per-conversation retrieval over a fleet directory, with follow-up turns behind their kept KV."""

    def __init__(
        self, lm: LoadedModel, directory: str | Path, rag_docs: int | None = None, adaptive: bool = False,
        margin: float = 0.05, max_conversations: int = 256, max_conversation_rows: int = 32768,
        name: str | None = None,
    ) -> None:
        if rag_docs is not None and rag_docs < 1:
            raise CartridgeError(f"--rag-docs must be >= 1, got {rag_docs}")
        if margin < 0:
            raise CartridgeError(f"--rag-margin must be >= 0, got {margin}")
        self.lm = lm
        self.directory = Path(directory)
        self.adaptive, self.margin = adaptive, margin
        self.max_conversations, self.max_conversation_rows = max_conversations, max_conversation_rows
        self._rag_docs = rag_docs
        self._lock = threading.Lock()  # conversations and the state swap
        self._reload_lock = threading.Lock()
        self.switches = 0
        self._state = self._open(version=1)
        self.model_id = name or self.directory.resolve().name

    @property
    def rag_docs(self) -> int:
        return self._rag_docs if self._rag_docs is not None else self._state.fleet.rag_docs

    def _open(self, version: int) -> _Opened:
        fleet = Fleet.open(self.directory, self.lm)
        fleet.index()  # a missing or corrupted index fails here, not on the first request
        if not fleet.names:
            raise CartridgeError(f"{self.directory}: the fleet has no documents")
        published = fleet.directory.name if is_versioned(self.directory) else None
        return _Opened(fleet, version, time.time(), published,
                       Conversations(self.max_conversations, self.max_conversation_rows))

    # --- on the engine thread -------------------------------------------------------------
    def select(self, messages: list[dict], _retry: bool = True) -> Selection:
        state = self._state  # one read: a reload swaps fleet and conversations together
        key = identity(messages)
        users = user_messages(messages)
        if key is None or not any(u.strip() for u in users[:1]):
            raise bad_request("fleet mode retrieves documents with the first user message; send one with text",
                              param="messages", code="no_user_message")
        full = render_prompt(self.lm.tokenizer, messages)
        with self._lock:
            conv = state.conversations.get(key)
        try:
            names = self._choose(state.fleet, conv, users)
            cached = 0
            if conv is not None and conv.kv is not None and names == conv.names:
                cached = min(common_length(full, conv.ids), len(full) - 1)  # at least one token to prefill
            if cached > 0:
                assert conv is not None
                rows, prompt = conv.reuse(cached), full[cached:]
            else:
                rows, prompt = self._rows(state, names), full
        except CartridgeError as exc:  # a fleet file went bad under us: the server's fault, not the client's
            if _retry and self._pruned(state):
                # Cartridges load on first use; retention removed this version (the server missed the
                # reloads of the versions after it): serve the live one instead of failing.
                self.reload()
                return self.select(messages, _retry=False)
            raise internal(f"fleet {self.directory}: {exc}") from exc
        with self._lock:
            if conv is None or names != conv.names:
                state.conversations.put(key, Conversation(names))
        p = prefix_length(rows) - cached  # cartridge rows

        def keep(kv: list, tokens: list[int]) -> None:
            ids = full + tokens[:-1]  # the last token was chosen, never fed
            if prefix_length(kv) != p + len(ids):
                return
            with self._lock:
                if self._state is not state:  # reloaded since: the new version starts clean
                    return
                state.conversations.put(key, Conversation(names, ids, kv))

        return Selection(rows=rows, prompt=prompt, names=names, cached_tokens=cached, version=state.version,
                         fleet_version=state.fleet_version, on_finish=keep)

    def _pruned(self, state: _Opened) -> bool:
        """Whether the published version `state` serves has been removed (or is being removed)."""
        d = state.fleet.directory
        return state.fleet_version is not None and not (d.is_dir() and (d / MANIFEST).is_file())

    def _choose(self, fleet: Fleet, conv: Conversation | None, users: list[str]) -> tuple[str, ...]:
        k = self.rag_docs
        if conv is None:
            return tuple(fleet.select(users[0], k))
        if not self.adaptive or len(users) < 2 or not users[-1].strip():
            return conv.names
        ranked = fleet.search(users[-1], k=len(fleet.names), chunks=len(fleet.index().chunk_docs))
        if switches(ranked, conv.names, self.margin):
            self.switches += 1
            return tuple(name for name, _ in ranked[:k])
        return conv.names

    def _rows(self, state: _Opened, names: tuple[str, ...]) -> Rows:
        """The documents' cartridges composed (kept for reuse, so requests on one selection share a prefill)."""
        with self._lock:
            rows = state.composed.get(names)
            if rows is not None:
                state.composed.move_to_end(names)
                return rows
        rows = state.fleet.rows(list(names))
        with self._lock:
            state.composed[names] = rows
            while len(state.composed) > COMPOSED_CACHE:
                state.composed.popitem(last=False)
        return rows

    # --- from any thread ------------------------------------------------------------------
    def reload(self) -> dict:
        """Open the fleet directory again (a newer version); conversations start over.

        Streams already decoding keep the rows they were given; on any error the previous
        version stays in service and the error propagates.
        """
        with self._reload_lock:
            new = self._open(self._state.version + 1)
            with self._lock:
                self._state = new
        return self.describe()

    def describe(self) -> dict:
        state = self._state
        m = state.fleet.manifest
        with self._lock:
            conversations, rows = len(state.conversations), state.conversations.rows
        return {"mode": "fleet", "version": state.version, "loaded_at": state.loaded_at,
                "fleet": str(self.directory), "fleet_version": state.fleet_version,
                "documents": state.fleet.names, "p": m.p, "rounds": m.rounds,
                "rag_docs": self.rag_docs, "rag_adaptive": self.adaptive, "rag_margin": self.margin,
                "max_prefix_rows": self.rag_docs * m.p,
                "conversations": conversations, "conversation_rows": rows,
                "max_conversations": self.max_conversations, "max_conversation_rows": self.max_conversation_rows,
                "switches": self.switches}


def switches(ranked: list[tuple[str, float]], selected: tuple[str, ...], margin: float) -> bool:
    """Whether a document outside `selected` scores more than `margin` above every selected one.

    `ranked` is (name, score) best first; a selected document missing from it scores below
    everything listed.
    """
    scores = dict(ranked)
    outside = [s for n, s in ranked if n not in selected]
    if not outside:
        return False
    inside = [scores[n] for n in selected if n in scores]
    best_inside = max(inside) if inside else float("-inf")
    return max(outside) - best_inside > margin
