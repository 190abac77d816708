"""A trained fleet as a reader sees it: pick documents for a query, compose their rows."""

from __future__ import annotations

from pathlib import Path

from cartridges.core.cartridge import Cartridge, compose_rows
from cartridges.core.errors import FleetError
from cartridges.core.models import LoadedModel
from cartridges.core.prefix import Rows
from cartridges.core.similarity import embed_text
from cartridges.fleet.index import Index
from cartridges.fleet.manifest import Manifest, check_model, read_manifest, resolve
from cartridges.fleet.residents import load_rows


class Fleet:
    """A fleet directory opened for serving (read-only).

    >>> fleet = Fleet.open("fleet/", lm)
    >>> names = fleet.select("How are draft tokens verified?", k=2)
    >>> rows = fleet.rows(names)   # composed prefix rows, in the order given
    """

    def __init__(self, directory: Path, lm: LoadedModel, manifest: Manifest) -> None:
        self.directory = Path(directory)
        self.lm = lm
        self.manifest = manifest
        self._index: Index | None = None
        self._carts: dict[str, Cartridge] = {}

    @classmethod
    def open(cls, directory: str | Path, lm: LoadedModel) -> Fleet:
        """A fleet directory, or a published fleet root: then the version `current` points at now."""
        directory = resolve(directory)
        manifest = read_manifest(directory)
        check_model(manifest, lm.fingerprint, directory)
        return cls(Path(directory), lm, manifest)

    @property
    def names(self) -> list[str]:
        """Document names in doc-id order."""
        return [d.name for d in sorted(self.manifest.documents, key=lambda d: d.doc_id)]

    @property
    def rag_docs(self) -> int:
        return int(self.manifest.config.get("rag_docs", 2))

    @property
    def rag_chunks(self) -> int:
        return int(self.manifest.config.get("rag_chunks", 8))

    def index(self) -> Index:
        if self._index is None:
            if not self.manifest.index:
                raise FleetError(f"{self.directory}: the fleet has no retrieval index; build it with --rounds 0 --resume")
            self._index = Index.open(self.directory, self.manifest.index)
        return self._index

    def search(self, query: str, k: int | None = None, chunks: int | None = None) -> list[tuple[str, float]]:
        """(document name, best chunk score), best first, at most `k` documents."""
        if not query.strip():
            raise FleetError("empty query: nothing to retrieve with")
        k = self.rag_docs if k is None else k
        chunks = max(self.rag_chunks if chunks is None else chunks, k)
        vector = embed_text(self.lm.model, self.lm.tokenizer, query)
        return self.index().search(vector, k, chunks, query)

    def select(self, query: str, k: int | None = None) -> list[str]:
        """Names of the documents whose chunks best match `query`, best first."""
        return [name for name, _ in self.search(query, k)]

    def cartridge(self, name: str) -> Cartridge:
        """One document's cartridge (loaded once, in the model's dtype and device)."""
        if name not in self._carts:
            self._carts[name] = load_rows(self.directory, self.lm, self.manifest.entry(name))
        return self._carts[name]

    def rows(self, names: list[str]) -> Rows:
        """The named documents' cartridges composed in the order given."""
        if not names:
            return []
        return compose_rows([self.cartridge(n) for n in names])

    def prefix_length(self, names: list[str]) -> int:
        return sum(self.cartridge(n).p for n in names)
