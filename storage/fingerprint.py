"""Content fingerprints: equal fingerprints mean a stage's output can be reused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

_BLOCK = 1 << 20


def canonical_json(obj: Any) -> str:
    """One spelling per value, so logically equal configs hash equally."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False,
        default=_default,
    )


def _default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return obj.as_posix()
    if isinstance(obj, set | frozenset):
        return sorted(obj)
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    raise TypeError(f"cannot fingerprint a value of type {type(obj).__name__}: {obj!r}")


def fingerprint(stage: str, code_version: int | str, config: dict, inputs: list[str]) -> str:
    """sha256 over (stage, code version, config, input fingerprints in order)."""
    payload = {
        "stage": stage,
        "code_version": code_version,
        "config": config,
        "inputs": list(inputs),
    }
    return sha256_bytes(canonical_json(payload).encode("utf-8"))


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()
