"""The fleet manifest `fleet.json`: what a fleet directory holds, checked on every read.

The manifest names every file of the fleet; files are written first (atomically) and
the manifest last, so a crash leaves the previous consistent fleet. Cartridge and
optimizer files carry their document hash and step counter in their own metadata,
and the index files their sha256 here, so a swapped, stale or corrupted file is a
clear error instead of a silent mix. The manifest carries a sha256 of its own content
(`checksum`), so a flipped digit (a step counter, a round) is caught too.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cartridges.core.errors import FleetError
from storage.atomic import write_json_atomic
from storage.versions import current, is_versioned

MANIFEST = "fleet.json"
FORMAT = "cartridges-fleet"
FORMAT_VERSION = 1
INDEX_FILES = ("faiss", "chunks", "centroid")


@dataclass
class DocEntry:
    doc_id: int
    name: str
    sha256: str
    tokens: int
    steps: int = 0
    cartridge: str = ""
    optimizer: str = ""
    heldout_before: float | None = None

    def file_stem(self) -> str:
        return f"doc-{self.doc_id:03d}-{self.sha256[:8]}.s{self.steps:06d}"


@dataclass
class Manifest:
    model: dict
    p: int
    frozen: int
    seed: int
    embedding: dict
    rounds: int = 0
    residents: list[int] = field(default_factory=list)
    documents: list[DocEntry] = field(default_factory=list)
    index: dict | None = None
    config: dict = field(default_factory=dict)

    def by_name(self) -> dict[str, DocEntry]:
        return {d.name: d for d in self.documents}

    def by_id(self) -> dict[int, DocEntry]:
        return {d.doc_id: d for d in self.documents}

    def entry(self, name: str) -> DocEntry:
        found = self.by_name().get(name)
        if found is None:
            known = ", ".join(d.name for d in self.documents)
            raise FleetError(f"document {name!r} is not in this fleet (documents: {known})")
        return found

    def to_dict(self) -> dict:
        out = asdict(self)
        out = {"format": FORMAT, "format_version": FORMAT_VERSION, **out}
        return out


def resolve(directory: Path | str) -> Path:
    """A fleet directory, or a published fleet root (`versions/` + `current`): the version to read."""
    directory = Path(directory)
    if is_versioned(directory):
        version = current(directory)
        if version is None:
            raise FleetError(f"{directory}: fleet root has no published version (no valid 'current' link)")
        return version
    return directory


def _digest(data: dict) -> str:
    body = {k: v for k, v in data.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def write_manifest(directory: Path, manifest: Manifest) -> Path:
    data = manifest.to_dict()
    data["checksum"] = _digest(data)
    return write_json_atomic(Path(directory) / MANIFEST, data)


def _need(data: dict, key: str, kind: type | tuple[type, ...], where: str):
    if key not in data:
        raise FleetError(f"{where}: missing field {key!r}")
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise FleetError(f"{where}: field {key!r} has the wrong type ({type(value).__name__})")
    return value


def read_manifest(directory: Path | str) -> Manifest:
    """Parse and check `fleet.json`; any damage is a FleetError naming the file and field."""
    path = Path(directory) / MANIFEST
    if not Path(directory).is_dir():
        raise FleetError(f"{directory}: no such fleet directory")
    if not path.is_file():
        raise FleetError(f"{path}: no fleet manifest (is {directory} a fleet directory?)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FleetError(f"{path}: corrupted manifest, not valid JSON ({exc})") from exc
    where = str(path)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise FleetError(f"{path}: not a fleet manifest (format is not {FORMAT!r})")
    version = _need(data, "format_version", int, where)
    if version > FORMAT_VERSION:
        raise FleetError(f"{path}: format version {version} is newer than this build reads ({FORMAT_VERSION})")
    docs = []
    for i, raw in enumerate(_need(data, "documents", list, where)):
        at = f"{path}: documents[{i}]"
        if not isinstance(raw, dict):
            raise FleetError(f"{at}: not an object")
        entry = DocEntry(
            doc_id=_need(raw, "doc_id", int, at), name=_need(raw, "name", str, at),
            sha256=_need(raw, "sha256", str, at), tokens=_need(raw, "tokens", int, at),
            steps=_need(raw, "steps", int, at), cartridge=_need(raw, "cartridge", str, at),
            optimizer=_need(raw, "optimizer", str, at),
            heldout_before=raw.get("heldout_before"),
        )
        if entry.steps < 0 or entry.tokens < 0:
            raise FleetError(f"{at}: negative steps or tokens")
        for name in (entry.cartridge, entry.optimizer):
            if not name or Path(name).name != name:
                raise FleetError(f"{at}: file name {name!r} is not a plain file name")
        docs.append(entry)
    ids = [d.doc_id for d in docs]
    names = [d.name for d in docs]
    if len(set(ids)) != len(ids) or len(set(names)) != len(names):
        raise FleetError(f"{path}: duplicate document ids or names")
    manifest = Manifest(
        model=_need(data, "model", dict, where), p=_need(data, "p", int, where),
        frozen=_need(data, "frozen", int, where), seed=_need(data, "seed", int, where),
        embedding=_need(data, "embedding", dict, where), rounds=_need(data, "rounds", int, where),
        residents=_need(data, "residents", list, where), documents=docs,
        index=data.get("index"), config=data.get("config") or {},
    )
    unknown = [r for r in manifest.residents if r not in set(ids)]
    if unknown:
        raise FleetError(f"{path}: residents {unknown} are not documents of the fleet")
    if manifest.index is not None:
        if not isinstance(manifest.index, dict):
            raise FleetError(f"{path}: field 'index' has the wrong type")
        for key in INDEX_FILES:
            _need(manifest.index, key, str, f"{where}: index")
            _need(manifest.index, f"{key}_sha256", str, f"{where}: index")
    if "checksum" in data and data["checksum"] != _digest(data):  # manifests before checksums have none
        raise FleetError(f"{path}: checksum mismatch, the manifest is corrupted (or was edited by hand)")
    return manifest


def check_model(manifest: Manifest, fingerprint: dict, directory: Path | str) -> None:
    """A fleet trained for another model is an error naming both."""
    made = manifest.model
    for key in ("architecture", "layers", "config_hash", "tokenizer_hash", "weights_hash"):
        if made.get(key) != fingerprint.get(key):
            raise FleetError(
                f"{directory}: fleet was built for another model ({key}: {made.get(key)} != "
                f"{fingerprint.get(key)}; {made.get('architecture')} vs {fingerprint.get('architecture')})"
            )


def referenced(manifest: Manifest) -> set[str]:
    """Every file name the manifest points at."""
    names = {MANIFEST}
    for d in manifest.documents:
        names |= {d.cartridge, d.optimizer}
    if manifest.index:
        names |= {manifest.index[k] for k in INDEX_FILES}
    return names


def prune(directory: Path | str, manifest: Manifest) -> list[str]:
    """Delete fleet files the manifest no longer names (superseded checkpoints, removed documents)."""
    removed = []
    for path in Path(directory).iterdir():
        if path.is_file() and path.name not in referenced(manifest) and (
            path.name.startswith(("doc-", "index")) or (path.name.startswith(".") and path.name.endswith(".tmp"))
        ):
            path.unlink()
            removed.append(path.name)
    return sorted(removed)
