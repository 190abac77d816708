"""Parquet shards: an artifact is a directory of ``part-NNNNN.parquet`` files.

Each shard is written atomically, so after a crash every ``part-*`` file is
whole and a rerun can skip exactly the shards that exist. Data pages carry CRC32
checksums (Parquet's own), verified on read, so a flipped bit is an error naming
the file rather than a silently wrong value.
"""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from storage.atomic import atomic_path, is_temp
from storage.errors import StoreError

SHARD_GLOB = "part-*.parquet"
_SHARD_RE = re.compile(r"^part-(\d{5,})\.parquet$")


def shard_name(index: int) -> str:
    if index < 0:
        raise ValueError(f"shard index must be >= 0, got {index}")
    return f"part-{index:05d}.parquet"


def write_shard(directory: Path | str, index: int, table: pa.Table) -> Path:
    """Write shard ``index``; an existing shard with that index is replaced whole."""
    target = Path(directory) / shard_name(index)
    with atomic_path(target) as tmp:
        pq.write_table(table, tmp, write_page_checksum=True)
    return target


def done_shards(directory: Path | str) -> dict[int, Path]:
    """Finished shards by index (in-progress temp files are not shards)."""
    d = Path(directory)
    if not d.is_dir():
        return {}
    found: dict[int, Path] = {}
    for p in d.iterdir():
        m = _SHARD_RE.match(p.name)
        if m and p.is_file():
            found[int(m.group(1))] = p
    return dict(sorted(found.items()))


REWRITE_HINT = "; delete it and rerun the stage to rewrite it"


def _unreadable(path: Path, e: Exception) -> StoreError:
    reason = " ".join(str(e).split()) or type(e).__name__
    return StoreError(f"{path}: cannot read Parquet shard ({reason}){REWRITE_HINT}", path)


def read_shard(path: Path | str, schema: pa.Schema | None = None) -> pa.Table:
    path = Path(path)
    try:
        table = pq.read_table(path, page_checksum_verification=True)
    except Exception as e:  # damaged files surface as many error types
        raise _unreadable(path, e) from e
    if schema is None:
        return table
    missing = [n for n in schema.names if n not in table.column_names]
    if missing:
        raise StoreError(f"{path}: shard lacks column(s) {', '.join(missing)}", path)
    try:
        return table.select(schema.names).cast(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as e:
        raise StoreError(f"{path}: shard does not match the expected schema: {e}", path) from e


def read_table(directory: Path | str, schema: pa.Schema | None = None) -> pa.Table:
    """All shards concatenated in index order; with ``schema``, cast to it."""
    shards = done_shards(directory)
    if not shards:
        return schema.empty_table() if schema is not None else pa.table({})
    tables = [read_shard(p, schema) for p in shards.values()]
    try:
        return pa.concat_tables(tables, promote_options="default" if schema is None else "none")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise StoreError(f"{directory}: shards have incompatible schemas: {e}", directory) from e


def count_rows(directory: Path | str) -> int:
    """Rows over all shards, from the Parquet footers only."""
    total = 0
    for path in done_shards(directory).values():
        try:
            total += pq.ParquetFile(path).metadata.num_rows
        except Exception as e:
            raise _unreadable(path, e) from e
    return total


def dir_bytes(directory: Path | str) -> int:
    """Bytes of every finished file below ``directory`` (temp files excluded)."""
    d = Path(directory)
    if not d.is_dir():
        return 0
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file() and not is_temp(p))


def remove_temps(directory: Path | str) -> int:
    """Delete temp files a crashed writer left behind; returns how many."""
    d = Path(directory)
    if not d.is_dir():
        return 0
    removed = 0
    for p in d.rglob("*"):
        if p.is_file() and is_temp(p):
            p.unlink(missing_ok=True)
            removed += 1
    return removed
