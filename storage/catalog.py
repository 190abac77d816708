"""The DuckDB catalog: which artifact versions exist, their status, and the runs.

DuckDB admits one writing process and a writer excludes readers in other
processes, so a connection lives for one transaction only; that lets
``cartridges sql`` read between the flow's writes. Lock conflicts are retried.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb

from storage.errors import StoreError

CATALOG_FILE = "catalog.duckdb"
CATALOG_VERSION = 1
STATUSES = ("running", "complete", "failed")
LOCK_WAIT_S = 30.0
DAMAGED = ("; if the file is damaged, move it aside and rerun: every stage runs again, "
           "keeping the whole shards already in place")

_DDL = [
    "CREATE TABLE IF NOT EXISTS meta (key VARCHAR PRIMARY KEY, value VARCHAR)",
    """CREATE TABLE IF NOT EXISTS artifacts (
        id VARCHAR PRIMARY KEY, stage VARCHAR NOT NULL, fingerprint VARCHAR NOT NULL,
        inputs JSON, config JSON, path VARCHAR NOT NULL, rows BIGINT, bytes BIGINT,
        status VARCHAR NOT NULL, error VARCHAR, run_id VARCHAR,
        started_at TIMESTAMP, finished_at TIMESTAMP, seconds DOUBLE, created_at TIMESTAMP)""",
    """CREATE TABLE IF NOT EXISTS runs (
        run_id VARCHAR PRIMARY KEY, flow VARCHAR NOT NULL, started_at TIMESTAMP NOT NULL,
        finished_at TIMESTAMP, status VARCHAR NOT NULL, summary JSON)""",
]
_COLUMNS = (
    "id, stage, fingerprint, inputs, config, path, rows, bytes, status, error, run_id, "
    "started_at, finished_at, seconds, created_at"
)
# One lock per catalog file: threads of the flow process take turns, and a
# read-only and a read-write connection never coexist in one process.
_LOCKS: dict[str, threading.RLock] = {}
_LOCKS_GUARD = threading.Lock()


def _now() -> datetime:
    """Naive UTC: DuckDB TIMESTAMP has no zone, and UTC is the stored convention."""
    return datetime.now(UTC).replace(tzinfo=None)


def _utc(ts: datetime | None) -> datetime | None:
    return ts.replace(tzinfo=UTC) if ts is not None else None


@dataclasses.dataclass(frozen=True)
class Artifact:
    """One catalog row: a versioned stage output living under ``root / path``."""

    id: str
    stage: str
    fingerprint: str
    inputs: tuple[str, ...]
    config: dict[str, Any] = dataclasses.field(hash=False)
    path: str
    rows: int | None
    bytes: int | None
    status: str
    error: str | None
    run_id: str | None
    started_at: datetime | None
    finished_at: datetime | None
    seconds: float | None
    created_at: datetime | None

    def abspath(self, root: Path | str) -> Path:
        return Path(root) / self.path

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    @classmethod
    def _from_row(cls, row: tuple) -> Artifact:
        (id_, stage, fp, inputs, config, path, rows, nbytes, status, error, run_id,
         started, finished, seconds, created) = row
        return cls(
            id=id_, stage=stage, fingerprint=fp,
            inputs=tuple(json.loads(inputs) if inputs else ()),
            config=json.loads(config) if config else {},
            path=path, rows=rows, bytes=nbytes, status=status, error=error, run_id=run_id,
            started_at=_utc(started), finished_at=_utc(finished), seconds=seconds,
            created_at=_utc(created),
        )


def artifact_id(stage: str, fingerprint: str) -> str:
    return f"{stage}-{fingerprint[:16]}"


def connect(path: Path, read_only: bool, wait_s: float = LOCK_WAIT_S) -> duckdb.DuckDBPyConnection:
    """Open ``path``, retrying while another process holds the lock; errors become StoreError."""
    if read_only and not path.exists():
        raise StoreError(f"{path}: no catalog yet (no runs have been recorded)", path)
    deadline = time.monotonic() + wait_s
    delay = 0.02
    while True:
        try:
            return duckdb.connect(str(path), read_only=read_only)
        except (duckdb.IOException, duckdb.ConnectionException) as e:
            msg = str(e)
            busy = "lock" in msg.lower() or "different configuration" in msg
            if busy and time.monotonic() < deadline:
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
                continue
            if busy:
                raise StoreError(f"{path}: catalog is busy (another process, or an open "
                                 f"connection in this one, holds it): {msg}",
                                 path) from e
            raise StoreError(f"{path}: cannot open the catalog: {msg}{DAMAGED}", path) from e
        except duckdb.Error as e:
            raise StoreError(f"{path}: cannot open the catalog: {e}{DAMAGED}", path) from e


def check_version(con: duckdb.DuckDBPyConnection, path: Path) -> int:
    """Refuse catalogs written by newer code instead of misreading them."""
    try:
        row = con.execute("SELECT value FROM meta WHERE key = 'catalog_version'").fetchone()
    except duckdb.CatalogException as e:
        raise StoreError(f"{path}: not a cartridges catalog (no meta table)", path) from e
    version = int(row[0]) if row else 0
    if version > CATALOG_VERSION:
        raise StoreError(
            f"{path}: catalog version {version} is newer than this code supports "
            f"({CATALOG_VERSION}); upgrade cartridges or use another store root", path)
    return version


class Catalog:
    """Artifact and run records in ``root/catalog.duckdb``; never holds a connection open."""

    def __init__(self, root: Path | str, read_only: bool = False) -> None:
        self.root = Path(root)
        self.path = self.root / CATALOG_FILE
        self.read_only = read_only
        if not read_only:
            self.root.mkdir(parents=True, exist_ok=True)
            self._init()

    def _lock(self) -> threading.RLock:
        key = str(self.path.resolve())
        with _LOCKS_GUARD:
            return _LOCKS.setdefault(key, threading.RLock())

    @contextmanager
    def _connect(self, read_only: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
        """One short transaction; the connection is closed on exit."""
        if self.read_only and not read_only:
            raise StoreError(f"{self.path}: catalog was opened read-only", self.path)
        with self._lock():
            con = connect(self.path, read_only=self.read_only or read_only)
            try:
                if not read_only:
                    con.begin()
                yield con
                if not read_only:
                    con.commit()
            except duckdb.Error as e:
                raise StoreError(f"{self.path}: catalog query failed: {e}{DAMAGED}", self.path) from e
            finally:
                con.close()

    def _init(self) -> None:
        with self._connect() as con:
            for ddl in _DDL:
                con.execute(ddl)
            check_version(con, self.path)
            con.execute(
                "INSERT INTO meta VALUES ('catalog_version', ?) ON CONFLICT DO NOTHING",
                [str(CATALOG_VERSION)],
            )

    @staticmethod
    def _fetch(con: duckdb.DuckDBPyConnection, where: str = "", params: list | None = None,
               order: str = "created_at") -> list[Artifact]:
        sql = f"SELECT {_COLUMNS} FROM artifacts {where} ORDER BY {order}"
        return [Artifact._from_row(r) for r in con.execute(sql, params or []).fetchall()]

    def _select(self, where: str = "", params: list | None = None,
                order: str = "created_at") -> list[Artifact]:
        if self.read_only and not self.path.exists():
            return []
        with self._connect(read_only=True) as con:
            if self.read_only:
                check_version(con, self.path)
            return self._fetch(con, where, params, order)

    def get(self, artifact_id: str) -> Artifact | None:
        found = self._select("WHERE id = ?", [artifact_id])
        return found[0] if found else None

    def find(self, stage: str, fingerprint: str) -> Artifact | None:
        found = self._select("WHERE stage = ? AND fingerprint = ?", [stage, fingerprint])
        return found[0] if found else None

    def latest(self, stage: str) -> Artifact | None:
        found = self._select("WHERE stage = ? AND status = 'complete'", [stage],
                             order="finished_at DESC, created_at DESC LIMIT 1")
        return found[0] if found else None

    def artifacts(self, stage: str | None = None) -> list[Artifact]:
        if stage is None:
            return self._select()
        return self._select("WHERE stage = ?", [stage])

    def begin(self, stage: str, fingerprint: str, inputs: list[str], config: dict,
              run_id: str | None = None) -> Artifact:
        """Insert a running row, or re-mark an existing one; its path (and shards) stay."""
        aid = artifact_id(stage, fingerprint)
        now = _now()
        with self._connect() as con:
            row = con.execute("SELECT fingerprint FROM artifacts WHERE id = ?", [aid]).fetchone()
            if row is None:
                con.execute(
                    f"INSERT INTO artifacts ({_COLUMNS}) VALUES "
                    "(?, ?, ?, ?, ?, ?, NULL, NULL, 'running', NULL, ?, ?, NULL, NULL, ?)",
                    [aid, stage, fingerprint, json.dumps(list(inputs)),
                     json.dumps(config, sort_keys=True), f"{stage}/{aid}", run_id, now, now],
                )
            elif row[0] != fingerprint:
                raise StoreError(f"{self.path}: artifact id {aid} already names fingerprint "
                                 f"{row[0]}, not {fingerprint}", self.path)
            else:
                con.execute(
                    "UPDATE artifacts SET status = 'running', error = NULL, rows = NULL, "
                    "bytes = NULL, run_id = ?, started_at = ?, finished_at = NULL, "
                    "seconds = NULL WHERE id = ?",
                    [run_id, now, aid],
                )
            return self._fetch(con, "WHERE id = ?", [aid])[0]

    def _finish(self, aid: str, status: str, rows: int | None, nbytes: int | None,
                error: str | None) -> Artifact:
        now = _now()
        with self._connect() as con:
            found = con.execute("SELECT started_at FROM artifacts WHERE id = ?", [aid]).fetchone()
            if found is None:
                raise StoreError(f"{self.path}: no artifact {aid!r} in the catalog", self.path)
            seconds = (now - found[0]).total_seconds() if found[0] else None
            con.execute(
                "UPDATE artifacts SET status = ?, rows = ?, bytes = ?, error = ?, "
                "finished_at = ?, seconds = ? WHERE id = ?",
                [status, rows, nbytes, error, now, seconds, aid],
            )
            return self._fetch(con, "WHERE id = ?", [aid])[0]

    def complete(self, artifact_id: str, rows: int, bytes: int) -> Artifact:
        return self._finish(artifact_id, "complete", rows, bytes, None)

    def fail(self, artifact_id: str, error: str) -> Artifact:
        return self._finish(artifact_id, "failed", None, None, error)

    def delete(self, artifact_id: str) -> None:
        with self._connect() as con:
            con.execute("DELETE FROM artifacts WHERE id = ?", [artifact_id])

    def start_run(self, flow: str, run_id: str | None = None) -> str:
        run_id = run_id or f"{flow}-{_now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"
        with self._connect() as con:
            con.execute(
                "INSERT INTO runs VALUES (?, ?, ?, NULL, 'running', NULL) "
                "ON CONFLICT (run_id) DO UPDATE SET status = 'running', finished_at = NULL",
                [run_id, flow, _now()],
            )
        return run_id

    def finish_run(self, run_id: str, status: str, summary: dict | None = None) -> None:
        with self._connect() as con:
            con.execute(
                "UPDATE runs SET status = ?, finished_at = ?, summary = ? WHERE run_id = ?",
                [status, _now(), json.dumps(summary or {}, sort_keys=True, default=str), run_id],
            )

    @contextmanager
    def failing_run(self, run_id: str) -> Iterator[None]:
        """Record the run as failed (with the error) if the block raises; the block finishes it on success."""
        try:
            yield
        except BaseException as exc:
            try:
                self.finish_run(run_id, "failed", {"error": str(exc)})
            except StoreError as record_error:  # a full disk fails the record too: keep the cause
                exc.add_note(f"(could not record the failure in the catalog: {record_error})")
            raise

    def runs(self) -> list[dict[str, Any]]:
        if self.read_only and not self.path.exists():
            return []
        with self._connect(read_only=True) as con:
            rows = con.execute(
                "SELECT run_id, flow, started_at, finished_at, status, summary FROM runs "
                "ORDER BY started_at").fetchall()
        return [
            {"run_id": r[0], "flow": r[1], "started_at": _utc(r[2]), "finished_at": _utc(r[3]),
             "status": r[4], "summary": json.loads(r[5]) if r[5] else None}
            for r in rows
        ]
