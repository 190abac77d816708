"""Which prefix rows a request sits behind: the seam between the decode loop and the prefix source.

A selector turns a conversation into a `Selection`: the prefix rows every token of the
request reads, the prompt ids to prefill behind them, the names of the cartridges (or
documents) behind the answer, and how many conversation tokens the rows already hold
(KV reused from an earlier turn, reported as cached tokens). The engine calls `select`
on its own thread (it owns the model, so a selector may run the model, e.g. to embed a
query), and hands a finished stream's rows to `on_finish` when a selection asks for them.

Cartridge mode composes the loaded files in the order given. `reload` reads them again
and swaps the rows atomically: streams already decoding keep the rows they started with.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from cartridges.core.cartridge import compose_rows
from cartridges.core.chat import without_system
from cartridges.core.files import check_fits, load_cartridge
from cartridges.core.models import LoadedModel
from cartridges.core.prefix import Rows, prefix_length


@dataclass(frozen=True)
class Selection:
    rows: Rows  # per layer (keys [H, n, d], values): cartridge rows, then any reused conversation KV
    prompt: list[int]  # token ids prefilled behind `rows`
    names: tuple[str, ...]  # cartridges / documents behind the answer
    cached_tokens: int = 0  # conversation tokens already inside `rows`
    draft_reference: tuple[int, ...] = ()  # text drafts may come from (`serve --spec`): the cartridges' corpora
    version: int = 0  # the selector's version when selected (reload counter)
    fleet_version: str | None = None  # the published fleet version the rows were read from (`versions/NNNN`)
    # Called on the engine thread with the stream's rows (prefix, prompt, tokens fed) and its
    # tokens when it finishes: how fleet follow-ups keep a conversation's KV.
    on_finish: Callable[[list[tuple[torch.Tensor, torch.Tensor]], list[int]], None] | None = field(
        default=None, compare=False)

    @property
    def cartridge_rows(self) -> int:
        return prefix_length(self.rows) - self.cached_tokens


class Selector(Protocol):
    model_id: str  # the id clients name in requests and /v1/models lists

    def select(self, messages: list[dict]) -> Selection: ...

    def reload(self) -> dict: ...

    def describe(self) -> dict: ...


def render_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Messages as the student saw them in training: the cartridge takes the system turn's place.

    Rendering behind a placeholder system turn and cutting it keeps the chat template from
    injecting its default system prompt.
    """
    return without_system(tokenizer, [{"role": "system", "content": "-"}, *messages], add_generation_prompt=True)


@dataclass(frozen=True)
class _Loaded:
    rows: Rows
    draft_reference: tuple[int, ...]
    names: tuple[str, ...]
    files: tuple[dict, ...]
    version: int
    loaded_at: float


class CartridgeSelector:
    """Every request sits behind the same cartridge files, composed in the order given."""

    def __init__(self, lm: LoadedModel, paths: list[str], name: str | None = None) -> None:
        self.lm = lm
        self.paths = [str(p) for p in paths]
        self._lock = threading.Lock()
        self._state = self._load(version=1)
        self.model_id = name or "+".join(self._state.names)

    def _load(self, version: int) -> _Loaded:
        parts, files, draft = [], [], []
        for path in self.paths:
            cart = load_cartridge(path, device=self.lm.device, dtype=self.lm.dtype)
            check_fits(cart, self.lm.fingerprint, path)
            parts.append(cart)
            if cart.meta.get("draft_reference") is not None:
                draft += [int(t) for t in cart.meta["draft_reference"].tolist()]
            files.append({"path": path, "p": cart.p, "steps": cart.meta.get("steps"),
                          "mtime": Path(path).stat().st_mtime})
        with torch.no_grad():
            rows = [(k.detach(), v.detach()) for k, v in compose_rows(parts)]
        names = tuple(Path(p).stem for p in self.paths)
        return _Loaded(rows, tuple(draft), names, tuple(files), version, time.time())

    def select(self, messages: list[dict]) -> Selection:
        state = self._state  # one read: a concurrent reload swaps the whole state
        prompt = render_prompt(self.lm.tokenizer, messages)
        return Selection(rows=state.rows, prompt=prompt, names=state.names, version=state.version,
                         draft_reference=state.draft_reference)

    def reload(self) -> dict:
        """Read the files again; on any error the old rows stay in service and the error propagates."""
        with self._lock:
            self._state = self._load(self._state.version + 1)
        return self.describe()

    def describe(self) -> dict:
        state = self._state
        return {"mode": "cartridge", "version": state.version, "loaded_at": state.loaded_at,
                "prefix_rows": prefix_length(state.rows), "cartridges": list(state.files)}
