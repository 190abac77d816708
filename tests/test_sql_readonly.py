"""`cartridges sql` only reads: statements that would change the catalog or write files are refused."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pytest

from cli.main import main
from storage import Store, StoreError, query

pytestmark = pytest.mark.reliability


def _store(root: Path) -> tuple[Store, Path]:
    store = Store(root)
    run_id = store.catalog.start_run("cartridge")

    def fn(ctx) -> None:
        ctx.write_shard(0, pa.table({
            "run_id": ["r0", "r1"], "arm": ["cartridge"] * 2, "metric": ["acc"] * 2,
            "value": [0.5, 0.75], "n": [10, 10], "details": ["{}"] * 2,
        }))

    art = store.run("eval", 1, {}, [], fn, run_id=run_id)
    store.catalog.finish_run(run_id, "complete", {})
    shard = next(store.dir(art).glob("part-*.parquet"))
    return store, shard


def _state(root: Path) -> tuple:
    files = {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(root.rglob("*")) if p.is_file()}
    return (files, query(root, "SELECT id, status, rows FROM artifacts")[1],
            query(root, "SELECT run_id, status FROM runs")[1], query(root, "SELECT * FROM meta")[1],
            query(root, "SELECT value FROM evals ORDER BY value")[1])


WRITES = [
    ("DELETE FROM artifacts", "DELETE"),
    ("DROP TABLE runs", "DROP"),
    ("INSERT INTO meta VALUES ('x', 'y')", "INSERT"),
    ("UPDATE artifacts SET status = 'failed'", "UPDATE"),
    ("CREATE TABLE t AS SELECT 1", "CREATE"),
    ("SELECT 1; DELETE FROM artifacts", "DELETE"),
    ("COPY (SELECT 1 AS value) TO '{shard}' (FORMAT parquet)", "COPY"),
    ("EXPLAIN ANALYZE COPY (SELECT 1 AS value) TO '{shard}' (FORMAT parquet)", "COPY"),
    ("EXPORT DATABASE '{root}/export'", "EXPORT"),
    ("ATTACH '{root}/other.duckdb' AS other", "ATTACH"),
]


@pytest.mark.parametrize(("statement", "kind"), WRITES, ids=[k + str(i) for i, (_, k) in enumerate(WRITES)])
def test_write_statements_are_refused_with_one_line_and_the_store_is_intact(tmp_path, capsys, statement, kind):
    root = tmp_path / "store"
    _, shard = _store(root)
    before = _state(root)
    sql = statement.format(shard=shard, root=root)
    assert main(["sql", sql, "--store", str(root)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert err.startswith("error: cartridges sql only reads:") and f"{kind} statements are refused" in err
    assert _state(root) == before
    with pytest.raises(StoreError, match="only reads"):
        query(root, sql)


def test_reads_still_work(tmp_path, capsys):
    root = tmp_path / "store"
    _store(root)
    assert main(["sql", "SELECT count(*) AS n FROM evals", "--store", str(root), "--json"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == '{"columns": ["n"], "rows": [[2]]}'
    for sql in ("EXPLAIN SELECT * FROM artifacts", "PRAGMA version", "DESCRIBE artifacts",
                "WITH x AS (SELECT value FROM evals) SELECT max(value) FROM x", "CALL pragma_version()"):
        assert main(["sql", sql, "--store", str(root)]) == 0, sql
    assert main(["sql", "SELEC nonsense", "--store", str(root)]) == 2
    assert "syntax" in capsys.readouterr().err.lower()
