"""The one error type the store raises for problems a user can act on."""

from __future__ import annotations

from pathlib import Path


class StoreError(Exception):
    """A store problem worth showing to a user: the message names the file and what is wrong."""

    def __init__(self, message: str, path: Path | str | None = None) -> None:
        super().__init__(message)
        self.path = Path(path) if path is not None else None
