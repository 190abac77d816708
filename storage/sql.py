"""Read-only SQL over the store: one view per table, over its latest complete version.

Views name Parquet paths relative to the store root (DuckDB's
``file_search_path``), so a store can be moved or mounted elsewhere.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import duckdb

from schemas import TABLES
from storage.catalog import CATALOG_FILE, check_version, connect
from storage.errors import StoreError
from storage.shards import SHARD_GLOB, done_shards

# The table each stage's own shards hold (other stages' own shards get a view
# named after the stage); a stage may add sub-tables as sub-directories named
# after the table (``<artifact>/train_steps/part-*.parquet``).
STAGE_TABLES: dict[str, str] = {
    "ingest": "documents",
    "chunks": "chunks",
    "synthesize": "conversations",
    "teacher": "targets",
    "train": "train_steps",
    "eval": "evals",
    "bench": "benchmarks",
    "index": "index_chunks",
    "facts": "sentences",
}
CATALOG_TABLES = ("artifacts", "runs", "meta")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def view_sources(con: duckdb.DuckDBPyConnection, root: Path) -> dict[str, str]:
    """Table name -> shard glob relative to ``root``, from the newest complete producer."""
    rows = con.execute(
        "SELECT stage, path FROM artifacts WHERE status = 'complete' "
        "ORDER BY finished_at DESC, created_at DESC"
    ).fetchall()
    sources: dict[str, str] = {}
    for stage, rel in rows:
        directory = root / rel
        if not directory.is_dir():
            continue
        for sub in sorted(directory.iterdir()):
            name = sub.name
            if (sub.is_dir() and _IDENT.match(name) and name not in CATALOG_TABLES
                    and name not in sources and done_shards(sub)):
                sources[name] = f"{rel}/{name}/{SHARD_GLOB}"
        own = STAGE_TABLES.get(stage) or (
            stage if _IDENT.match(stage) and stage not in CATALOG_TABLES else None)
        if own and own not in sources and done_shards(directory):
            sources[own] = f"{rel}/{SHARD_GLOB}"
    return sources


def open_views(root: Path | str, read_only: bool = True) -> duckdb.DuckDBPyConnection:
    """A connection to the catalog with a TEMP view per available table; the caller closes it."""
    root = Path(root).expanduser().resolve()
    path = root / CATALOG_FILE
    if not path.exists():
        raise StoreError(f"{path}: no catalog yet; no runs have been recorded under {root}", path)
    con = connect(path, read_only=read_only)
    try:
        check_version(con, path)
        con.execute(f"SET file_search_path = {_literal(str(root))}")
        for name, glob in view_sources(con, root).items():
            con.execute(
                f'CREATE OR REPLACE TEMP VIEW "{name}" AS '
                f"SELECT * FROM read_parquet({_literal(glob)}, union_by_name = true)"
            )
    except duckdb.Error as e:
        con.close()
        raise StoreError(f"{path}: cannot create the table views: {e}", path) from e
    except BaseException:
        con.close()
        raise
    return con


def known_views(root: Path | str) -> list[str]:
    """Names a query can use right now (parquet views plus the catalog tables)."""
    con = open_views(root)
    try:
        rows = con.execute(
            "SELECT view_name FROM duckdb_views() WHERE temporary ORDER BY view_name"
        ).fetchall()
    finally:
        con.close()
    return [r[0] for r in rows] + ["artifacts", "runs"]


# Statements that only read. Everything else (DELETE, DROP, INSERT, UPDATE, CREATE, COPY ...
# TO, EXPORT, ATTACH, INSTALL, ...) is refused before it runs: the catalog connection is
# read-only anyway, but COPY and EXPORT would write files, into the store as well.
READ_STATEMENTS = frozenset({"SELECT", "EXPLAIN", "PRAGMA", "CALL"})
_EXPLAIN = re.compile(r"^\s*explain\s+(analy[sz]e\s+)?", re.IGNORECASE)


def check_read_only(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    """Raise StoreError naming the first statement of ``sql`` that is not a read."""
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as e:
        raise StoreError(f"query failed: {e}") from e
    for statement in statements:
        kind = statement.type.name
        if kind == "EXPLAIN":  # EXPLAIN ANALYZE runs its statement: check that one too
            inner = _EXPLAIN.sub("", statement.query, count=1)
            if inner != statement.query:
                check_read_only(con, inner)
                continue
        if kind not in READ_STATEMENTS:
            raise StoreError(f"cartridges sql only reads: {kind} statements are refused "
                             "(the catalog is opened read-only; the pipeline alone changes the store)")


def query(root: Path | str, sql: str) -> tuple[list[str], list[tuple]]:
    """Run ``sql`` against the views; errors (syntax, missing table, bad shard, a statement
    that would write) are StoreError."""
    con = open_views(root)
    try:
        check_read_only(con, sql)
        cur = con.execute(sql)
        if cur.description is None:
            return [], []
        columns = [d[0] for d in cur.description]
        return columns, cur.fetchall()
    except duckdb.Error as e:
        raise StoreError(f"query failed: {e}{_hint(con, str(e))}") from e
    finally:
        con.close()


def _hint(con: duckdb.DuckDBPyConnection, message: str) -> str:
    """Say why a known table has no view yet, rather than leaving just 'does not exist'."""
    m = re.search(r"Table with name (\w+) does not exist", message)
    if not m or m.group(1) not in TABLES:
        return ""
    name = m.group(1)
    producers = [s for s, t in STAGE_TABLES.items() if t == name]
    who = f" (stage {producers[0]!r})" if producers else ""
    return f"\n(no complete artifact holds table {name!r} yet{who}; run the pipeline first)"


def _cell(value: Any, max_width: int) -> str:
    if value is None:
        text = "NULL"
    elif isinstance(value, float):
        text = f"{value:.6g}" if math.isfinite(value) else str(value)
    else:
        text = str(value)
    text = text.replace("\r", "").replace("\n", "⏎").replace("\t", " ")
    if len(text) > max_width:
        text = text[: max(max_width - 1, 0)] + "…"
    return text


def _numeric(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def format_table(columns: list[str], rows: list[tuple], max_width: int = 40) -> str:
    """Plain aligned text; numbers right-aligned, long cells cut with an ellipsis."""
    if not columns:
        return "(no result)"
    cells = [[_cell(v, max_width) for v in row] for row in rows]
    heads = [_cell(c, max_width) for c in columns]
    widths = [len(h) for h in heads]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    right = [bool(rows) and all(_numeric(r[i]) or r[i] is None for r in rows)
             for i in range(len(columns))]

    def line(values: list[str]) -> str:
        parts = [v.rjust(w) if r else v.ljust(w)
                 for v, w, r in zip(values, widths, right, strict=True)]
        return "  ".join(parts).rstrip()

    out = [line(heads), "  ".join("-" * w for w in widths)]
    out += [line(row) for row in cells]
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(out)
