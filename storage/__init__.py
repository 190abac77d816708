"""The artifact store: a DuckDB catalog of versioned Parquet artifacts, and atomic writes."""

from storage.atomic import atomic_path, atomic_write_bytes, write_json_atomic
from storage.catalog import CATALOG_FILE, CATALOG_VERSION, Artifact, Catalog, artifact_id
from storage.errors import StoreError
from storage.fingerprint import canonical_json, fingerprint, sha256_bytes, sha256_file
from storage.shards import count_rows, dir_bytes, done_shards, read_table, write_shard
from storage.sql import STAGE_TABLES, format_table, known_views, open_views, query
from storage.store import StageContext, StageResult, Store

__all__ = [
    "CATALOG_FILE",
    "CATALOG_VERSION",
    "STAGE_TABLES",
    "Artifact",
    "Catalog",
    "StageContext",
    "StageResult",
    "Store",
    "StoreError",
    "artifact_id",
    "atomic_path",
    "atomic_write_bytes",
    "canonical_json",
    "count_rows",
    "dir_bytes",
    "done_shards",
    "fingerprint",
    "format_table",
    "known_views",
    "open_views",
    "query",
    "read_table",
    "sha256_bytes",
    "sha256_file",
    "write_json_atomic",
    "write_shard",
]
