"""The artifact store: a DuckDB catalog of versioned Parquet artifacts, and atomic writes.

The modules that need DuckDB or Arrow load on first use of one of their names, so that
code needing only atomic writes or fingerprints (the engine's speed cache, the GPU check
on a machine without DuckDB) does not load them.
"""

from __future__ import annotations

import importlib
from typing import Any

from storage.atomic import atomic_path as atomic_path
from storage.atomic import atomic_write_bytes as atomic_write_bytes
from storage.atomic import write_json_atomic as write_json_atomic
from storage.errors import StoreError as StoreError
from storage.fingerprint import canonical_json as canonical_json
from storage.fingerprint import fingerprint as fingerprint
from storage.fingerprint import sha256_bytes as sha256_bytes
from storage.fingerprint import sha256_file as sha256_file

_LAZY = {
    "catalog": ("CATALOG_FILE", "CATALOG_VERSION", "Artifact", "Catalog", "artifact_id"),
    "shards": ("count_rows", "dir_bytes", "done_shards", "read_table", "write_shard"),
    "sql": ("STAGE_TABLES", "format_table", "known_views", "open_views", "query"),
    "store": ("StageContext", "StageResult", "Store"),
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}

__all__ = sorted([
    "StoreError", "atomic_path", "atomic_write_bytes", "canonical_json", "fingerprint",
    "sha256_bytes", "sha256_file", "write_json_atomic", *_MODULE_OF,
])


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'storage' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"storage.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
