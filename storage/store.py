"""The artifact store: run a stage once per fingerprint, resumably, and find its output.

Stages hand the store a function; the store decides whether it must run, gives
it a directory, and records the outcome in the catalog. A failed run keeps its
finished shards so the rerun only does the rest.

A complete artifact is never trusted blindly: before it is reused its files must add
up to the bytes and rows the catalog recorded (a truncated, missing or foreign shard
means the stage runs again), and a shard that fails to read later (a page checksum)
marks the artifact failed as corrupt, so the next run recomputes it from scratch.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pyarrow as pa

from schemas import TABLES, validate_table
from storage import shards
from storage.atomic import atomic_path, atomic_write_bytes
from storage.catalog import Artifact, Catalog
from storage.errors import StoreError
from storage.fingerprint import canonical_json, fingerprint
from storage.sql import STAGE_TABLES

HOME_ENV = "CARTRIDGES_HOME"
DEFAULT_ROOT = "artifacts"
CORRUPT = "corrupt: "  # error prefix of artifacts failed because a file of theirs is damaged


@dataclasses.dataclass(frozen=True)
class StageResult:
    """An artifact plus whether this call reused it; reads through to the artifact's fields."""

    artifact: Artifact
    skipped: bool

    def __getattr__(self, name: str) -> Any:
        if name == "artifact":
            raise AttributeError(name)
        return getattr(self.artifact, name)


def with_inputs(kept: set[str], by_id: dict[str, Artifact]) -> set[str]:
    """`kept` and every artifact that one of them was computed from, transitively."""
    closed, todo = set(kept), list(kept)
    while todo:
        art = by_id.get(todo.pop())
        for parent in art.inputs if art else ():
            if parent not in closed:
                closed.add(parent)
                todo.append(parent)
    return closed


def _artifact(x: Artifact | StageResult) -> Artifact:
    return x.artifact if isinstance(x, StageResult) else x


@dataclasses.dataclass
class StageContext:
    """What a stage function gets: its directory, inputs and config, and safe writers."""

    dir: Path
    store: Store
    artifact: Artifact
    inputs: list[Artifact]
    config: dict[str, Any]

    def _subdir(self, table: str | None) -> Path:
        return self.dir / table if table else self.dir

    def write_shard(self, index: int, data: pa.Table, table: str | None = None,
                    validate: bool = True) -> Path:
        """Write shard ``index`` (of sub-table ``table`` when given), checked against its schema.

        The schema is the sub-table's, else the one the stage produces by convention.
        """
        name = table or STAGE_TABLES.get(self.artifact.stage)
        if validate and name in TABLES:
            data = validate_table(name, data)
        return shards.write_shard(self._subdir(table), index, data)

    def done_shards(self, table: str | None = None) -> dict[int, Path]:
        return shards.done_shards(self._subdir(table))

    def path(self, name: str) -> Path:
        return self.dir / name

    def write_file(self, name: str, data: bytes) -> Path:
        return atomic_write_bytes(self.dir / name, data)

    def atomic_path(self, name: str) -> AbstractContextManager[Path]:
        """For writers that need a filename (safetensors, faiss): temp path, then rename."""
        return atomic_path(self.dir / name)

    def read(self, artifact: Artifact | StageResult, table: str | None = None,
             schema: pa.Schema | None = None) -> pa.Table:
        return self.store.table(artifact, table=table, schema=schema)


class Store:
    """A store root holding ``catalog.duckdb`` and one directory per artifact version."""

    def __init__(self, root: Path | str | None = None, read_only: bool = False) -> None:
        chosen = root if root is not None else os.environ.get(HOME_ENV) or DEFAULT_ROOT
        self.root = Path(chosen).expanduser().resolve()
        if not read_only:
            self.root.mkdir(parents=True, exist_ok=True)
        self.catalog = Catalog(self.root, read_only=read_only)

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r})"

    def dir(self, artifact: Artifact | StageResult) -> Path:
        return _artifact(artifact).abspath(self.root)

    def run(self, stage: str, code_version: int, config: dict,
            inputs: list[Artifact | StageResult], fn: Callable[[StageContext], Any],
            force: bool = False, run_id: str | None = None) -> StageResult:
        """Produce the artifact for (stage, code, config, inputs), reusing a complete one and resuming
        a failed one's shards; `force` computes it afresh."""
        arts = [_artifact(a) for a in inputs]
        for a in arts:
            if a.status != "complete":
                raise StoreError(f"{self.dir(a)}: input artifact {a.id} is {a.status}, "
                                 "not complete", self.dir(a))
        fp = fingerprint(stage, code_version, config, [a.fingerprint for a in arts])
        existing = self.catalog.find(stage, fp)
        if existing is not None and existing.status == "complete":
            directory = self.dir(existing)
            if directory.is_dir() and not force:
                problem = self.verify(existing)
                if problem is None:
                    return StageResult(existing, skipped=True)
                print(f"warning: {problem}; running stage {stage} again", file=sys.stderr, flush=True)
            shutil.rmtree(directory, ignore_errors=True)
        elif existing is not None and (force or (existing.error or "").startswith(CORRUPT)):
            # forced: computed afresh, not resumed; corrupt: its shards cannot be trusted
            shutil.rmtree(self.dir(existing), ignore_errors=True)
        art = self.catalog.begin(stage, fp, [a.id for a in arts], config, run_id)
        directory = self.dir(art)
        directory.mkdir(parents=True, exist_ok=True)
        shards.remove_temps(directory)
        ctx = StageContext(dir=directory, store=self, artifact=art, inputs=arts, config=config)
        try:
            fn(ctx)
            rows = self._rows(directory)
            nbytes = shards.dir_bytes(directory)
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt) and not hasattr(e, "stage"):
                e.stage = stage  # the innermost stage a stop interrupted, for its message
            try:
                self.catalog.fail(art.id, f"{type(e).__name__}: {e}"[:4000])
            except StoreError as record_error:
                e.add_note(f"(could not record the failure in the catalog: {record_error})")
            raise
        return StageResult(self.catalog.complete(art.id, rows, nbytes), skipped=False)

    def siblings(self, artifact: Artifact | StageResult, code_version: int) -> list[tuple[Artifact, list[Artifact]]]:
        """Other artifacts of the same stage, code and config, each with its inputs: runs whose
        inputs differ, so a stage can take over the parts of their output that its own inputs
        would produce again. The code version is proven by recomputing each fingerprint."""
        art = _artifact(artifact)
        config = canonical_json(art.config)
        found = []
        for other in self.catalog.artifacts(art.stage):
            if other.id == art.id or canonical_json(other.config) != config or (other.error or "").startswith(CORRUPT):
                continue
            inputs = [self.catalog.get(i) for i in other.inputs]
            if any(i is None for i in inputs):
                continue
            if fingerprint(art.stage, code_version, other.config, [i.fingerprint for i in inputs]) != other.fingerprint:
                continue
            if self.dir(other).is_dir():
                found.append((other, inputs))
        return found

    def verify(self, artifact: Artifact | StageResult) -> str | None:
        """Why a complete artifact's files cannot be reused (None: they can).

        Cheap: file sizes and Parquet footers only, against what the catalog recorded.
        """
        art = _artifact(artifact)
        directory = self.dir(art)
        if not directory.is_dir():
            return f"{directory}: artifact {art.id} has no directory"
        if art.bytes is not None and (found := shards.dir_bytes(directory)) != art.bytes:
            return f"{directory}: artifact {art.id} holds {found} bytes, the catalog recorded {art.bytes}"
        try:
            rows = self._rows(directory)
        except StoreError as e:
            return str(e)
        if art.rows is not None and rows != art.rows:
            return f"{directory}: artifact {art.id} holds {rows} rows, the catalog recorded {art.rows}"
        return None

    @staticmethod
    def _rows(directory: Path) -> int:
        """Rows of the artifact's own shards, else of its sub-table shards."""
        own = shards.count_rows(directory)
        if own or shards.done_shards(directory):
            return own
        return sum(shards.count_rows(d) for d in sorted(directory.iterdir()) if d.is_dir())

    def latest(self, stage: str) -> Artifact | None:
        return self.catalog.latest(stage)

    def table(self, artifact: Artifact | StageResult, table: str | None = None,
              schema: pa.Schema | None = None) -> pa.Table:
        """The artifact's rows (or its sub-table's), shards in order."""
        art = _artifact(artifact)
        directory = self.dir(art)
        if not directory.is_dir():
            raise StoreError(f"{directory}: artifact {art.id} has no directory "
                             "(garbage-collected or deleted?)", directory)
        try:
            return shards.read_table(directory / table if table else directory, schema)
        except StoreError as e:
            if art.status != "complete" or self.catalog.read_only or e.path is None or not e.path.is_file():
                raise
            self.catalog.fail(art.id, f"{CORRUPT}{e}"[:4000])
            raise StoreError(f"{str(e).removesuffix(shards.REWRITE_HINT)}; artifact {art.id} is now marked "
                             f"failed, the next run of stage {art.stage} recomputes it", e.path) from e

    def gc(self, keep: int = 1, dry_run: bool = False) -> list[str]:
        """Delete superseded and failed versions; the newest ``keep`` per stage and
        everything they were built from stay. Returns the ids removed."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        everything = self.catalog.artifacts()
        by_id = {a.id: a for a in everything}
        kept: set[str] = {a.id for a in everything if a.status == "running"}
        stages = sorted({a.stage for a in everything})
        for stage in stages:
            done = [a for a in everything if a.stage == stage and a.status == "complete"]
            done.sort(key=lambda a: (a.finished_at, a.created_at), reverse=True)
            kept.update(a.id for a in done[:keep])
        kept = with_inputs(kept, by_id)
        removed = [a.id for a in everything if a.id not in kept]
        if not dry_run:
            for aid in removed:
                shutil.rmtree(self.dir(by_id[aid]), ignore_errors=True)
                self.catalog.delete(aid)
        return removed
