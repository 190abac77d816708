"""Ingest: corpus files -> the ``documents`` table (one row per file).

The fingerprint covers the documents' names and content hashes and the
tokenizer, never paths or mtimes: touching or moving an unchanged corpus reuses
the existing artifact (and everything built from it), while any edit reruns.
A reused artifact keeps the paths and versions it was written with; versions are
informational (name-level change counters), not part of the identity.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from cartridges.core.corpus import expand, read_text
from cartridges.core.errors import CorpusError
from schemas import DOCUMENTS, IngestConfig
from stages.job import Job
from storage import StageContext, StageResult, Store, StoreError, done_shards
from storage.faults import fault_point

NAME = "ingest"
VERSION = 1
SHARD_CHARS = 32 * 1024 * 1024  # text per Parquet shard; bounds memory on big corpora
DEFAULT_CONFIG = IngestConfig()


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One validated corpus file: its document name, where it was read, and its content."""

    name: str
    path: Path
    sha256: str
    text: str


def tokenizer_identity(tokenizer) -> str:
    """A short hash of what decides token ids (vocab, merges, normalizer, added tokens).

    Runtime padding/truncation settings are left out: HF fast tokenizers change
    them per call, and they do not change the ids of unpadded text.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = backend.to_str()
        if backend.padding is not None or backend.truncation is not None:
            plain = Tokenizer.from_str(spec)
            plain.no_padding()
            plain.no_truncation()
            spec = plain.to_str()
    else:
        spec = json.dumps(sorted(tokenizer.get_vocab().items()), separators=(",", ":"))
    blob = f"{type(tokenizer).__name__}\n{spec}".encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _named_files(paths: list[str | Path], extensions: tuple[str, ...]) -> list[tuple[str, Path]]:
    """(name, path) per distinct file, in resolved-path order.

    A directory's files are named by their path inside it (the file name for a
    flat directory); a file given directly is named by its file name.
    """
    named: dict[Path, tuple[str, Path]] = {}
    for raw in paths:
        root = Path(raw)
        for f in expand([root], extensions):
            name = f.relative_to(root).as_posix() if root.is_dir() else f.name
            named.setdefault(f.resolve(), (name, f))
    by_name: dict[str, Path] = {}
    for name, path in named.values():
        if name in by_name:
            raise CorpusError(
                f"{path}: document name {name!r} is also used by {by_name[name]}; "
                "rename one of them or ingest them separately"
            )
        by_name[name] = path
    return [named[key] for key in sorted(named, key=lambda k: k.as_posix())]


def collect(paths: list[str | Path], config: IngestConfig = DEFAULT_CONFIG) -> list[SourceFile]:
    """Every input file, read and checked; the first unusable one is a CorpusError naming it."""
    if isinstance(paths, str | Path):
        paths = [paths]
    if not paths:
        raise CorpusError("no corpus paths given")
    out = []
    for name, path in _named_files(list(paths), config.extensions):
        text = read_text(path, config.max_bytes)
        data = path.read_bytes()
        if data.decode("utf-8", errors="replace").removeprefix("\ufeff") != text:
            raise CorpusError(f"{path}: file changed while it was being read; try again")
        out.append(SourceFile(name, path, hashlib.sha256(data).hexdigest(), text))
    return out


def document_rows(files: list[SourceFile], tokenizer,
                  previous: dict[str, tuple[str, int]] | None = None) -> list[dict]:
    """``documents`` rows in file order (doc_id 0..).

    ``previous`` maps a name to (sha256, version) of the last ingest: an unchanged
    document keeps its version, a changed one gets the next, a new one gets 1.
    """
    previous = previous or {}
    rows = []
    for doc_id, f in enumerate(files):
        ids = tokenizer(f.text, add_special_tokens=False)["input_ids"]
        old = previous.get(f.name)
        version = 1 if old is None else old[1] if old[0] == f.sha256 else old[1] + 1
        rows.append({
            "doc_id": doc_id, "name": f.name, "path": str(f.path.resolve()), "sha256": f.sha256,
            "tokens": len(ids), "chars": len(f.text), "version": version, "text": f.text,
        })
    return rows


def previous_versions(store: Store) -> dict[str, tuple[str, int]]:
    """name -> (sha256, version) from the latest complete ingest; empty when there is none."""
    latest = store.latest(NAME)
    if latest is None:
        return {}
    out: dict[str, tuple[str, int]] = {}
    for path in done_shards(store.dir(latest)).values():
        try:
            part = pq.read_table(path, columns=["name", "sha256", "version"]).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise StoreError(f"{path}: cannot read the previous documents table ({e}); "
                             "delete that ingest artifact or rerun it with force", path) from e
        out.update({r["name"]: (r["sha256"], int(r["version"])) for r in part})
    return out


def _batches(files: list[SourceFile]) -> list[list[SourceFile]]:
    batches: list[list[SourceFile]] = [[]]
    size = 0
    for f in files:
        if batches[-1] and size + len(f.text) > SHARD_CHARS:
            batches.append([])
            size = 0
        batches[-1].append(f)
        size += len(f.text)
    return batches


def run(job: Job, config: IngestConfig = DEFAULT_CONFIG) -> StageResult:
    """Ingest the job's corpus (files and directories); skipped when names, content and tokenizer match."""
    store, tokenizer = job.store, job.tokenizer
    files = collect(list(job.corpus), config)
    # The config itself stays out: the file list already reflects it, and raising
    # max_bytes must not retrain everything downstream of an unchanged corpus.
    fp_config = {
        "tokenizer": job.model_id or tokenizer_identity(tokenizer),
        "documents": [[f.name, f.sha256] for f in files],
    }
    # Read before Store.run: a forced rerun clears this fingerprint's own directory.
    previous = previous_versions(store)

    def work(ctx: StageContext) -> None:
        done = ctx.done_shards()
        start = 0
        for index, batch in enumerate(_batches(files)):
            if index not in done:
                rows = document_rows(batch, tokenizer, previous)
                for offset, row in enumerate(rows):
                    row["doc_id"] = start + offset
                ctx.write_shard(index, pa.Table.from_pylist(rows, schema=DOCUMENTS))
                fault_point(f"ingest.shard.{index}")
            start += len(batch)

    return store.run(NAME, VERSION, fp_config, [], work, force=job.forced(NAME), run_id=job.run_id)
