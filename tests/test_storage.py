"""The artifact store: atomic writes, fingerprints, skip/resume, versions, SQL views."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from storage import (
    CATALOG_FILE,
    Catalog,
    StageContext,
    Store,
    StoreError,
    atomic_path,
    atomic_write_bytes,
    count_rows,
    done_shards,
    fingerprint,
    format_table,
    query,
    read_table,
    sha256_bytes,
    sha256_file,
    write_json_atomic,
    write_shard,
)


def _evals(value: float, n: int = 3, offset: int = 0) -> pa.Table:
    return pa.table({
        "run_id": [f"r{i + offset}" for i in range(n)], "arm": ["cartridge"] * n,
        "metric": ["acc"] * n, "value": [value] * n, "n": [10] * n, "details": ["{}"] * n,
    })


def _writer(value: float, calls: list[int] | None = None):
    def fn(ctx: StageContext) -> None:
        if calls is not None:
            calls.append(1)
        ctx.write_shard(0, _evals(value))
    return fn


# --- atomic writes -----------------------------------------------------------------------

def test_atomic_path_leaves_target_untouched_when_body_raises(tmp_path: Path) -> None:
    target = tmp_path / "file.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".") and tmp.name.endswith(".tmp")
        tmp.write_bytes(b"new but half")
        raise RuntimeError("crash mid-write")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.bin"]


def test_atomic_writes_replace_whole_file(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "f.bin"
    atomic_write_bytes(target, b"one")
    atomic_write_bytes(target, b"two")
    assert target.read_bytes() == b"two"
    write_json_atomic(tmp_path / "x.json", {"b": 1, "a": [1, 2]})
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": [1, 2], "b": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sub", "x.json"]
    assert sha256_file(target) == hashlib.sha256(b"two").hexdigest() == sha256_bytes(b"two")


# --- fingerprints ------------------------------------------------------------------------

def test_fingerprint_matches_independent_canonical_hash() -> None:
    expected = hashlib.sha256(
        b'{"code_version":2,"config":{"a":1,"b":[1,2]},"inputs":["f1","f2"],"stage":"chunks"}'
    ).hexdigest()
    assert fingerprint("chunks", 2, {"b": [1, 2], "a": 1}, ["f1", "f2"]) == expected
    assert fingerprint("chunks", 2, {"a": 1, "b": [1, 2]}, ["f1", "f2"]) == expected


def test_fingerprint_is_sensitive_to_each_input() -> None:
    base = ("chunks", 1, {"seed": 7, "n": 64}, ["aaa", "bbb"])
    variants = [
        ("synthesize", 1, {"seed": 7, "n": 64}, ["aaa", "bbb"]),
        ("chunks", 2, {"seed": 7, "n": 64}, ["aaa", "bbb"]),
        ("chunks", "1", {"seed": 7, "n": 64}, ["aaa", "bbb"]),
        ("chunks", 1, {"seed": 8, "n": 64}, ["aaa", "bbb"]),
        ("chunks", 1, {"seed": 7, "n": 64, "x": None}, ["aaa", "bbb"]),
        ("chunks", 1, {"seed": 7, "n": 64}, ["aaa", "bbc"]),
        ("chunks", 1, {"seed": 7, "n": 64}, ["bbb", "aaa"]),
        ("chunks", 1, {"seed": 7, "n": 64}, ["aaa"]),
    ]
    prints = {fingerprint(*base)} | {fingerprint(*v) for v in variants}
    assert len(prints) == len(variants) + 1
    assert fingerprint(*base) == fingerprint(*base)


# --- Store.run: skip, versions, resume ---------------------------------------------------

def test_run_skips_same_fingerprint_and_versions_on_change(tmp_path: Path) -> None:
    store = Store(tmp_path)
    calls: list[int] = []
    first = store.run("eval", 1, {"k": 1}, [], _writer(1.0, calls))
    again = store.run("eval", 1, {"k": 1}, [], _writer(9.0, calls))
    assert (first.skipped, again.skipped, len(calls)) == (False, True, 1)
    assert again.id == first.id and again.status == "complete" and again.rows == 3
    assert store.table(again).column("value").to_pylist() == [1.0] * 3

    changed = store.run("eval", 1, {"k": 2}, [], _writer(2.0, calls))
    assert not changed.skipped and changed.id != first.id and len(calls) == 2
    assert store.latest("eval").id == changed.id
    ids = {a.id: a.status for a in store.catalog.artifacts("eval")}
    assert ids == {first.id: "complete", changed.id: "complete"}
    assert store.dir(first).is_dir()
    assert store.table(first).column("value").to_pylist() == [1.0] * 3

    assert pickle.loads(pickle.dumps(changed)) == changed  # results cross process pools

    downstream = store.run("index", 1, {}, [changed], lambda ctx: None)
    assert downstream.inputs == (changed.id,)
    assert downstream.fingerprint == fingerprint("index", 1, {}, [changed.fingerprint])
    code_bump = store.run("eval", 2, {"k": 2}, [], _writer(3.0, calls))
    assert not code_bump.skipped and code_bump.id != changed.id


def test_force_rerun_and_missing_directory_rerun(tmp_path: Path) -> None:
    store = Store(tmp_path)
    calls: list[int] = []
    first = store.run("eval", 1, {}, [], _writer(1.0, calls))
    (store.dir(first) / "stale.txt").write_text("x")
    forced = store.run("eval", 1, {}, [], _writer(5.0, calls), force=True)
    assert not forced.skipped and forced.id == first.id and len(calls) == 2
    assert not (store.dir(forced) / "stale.txt").exists()
    assert store.table(forced).column("value").to_pylist() == [5.0] * 3
    shutil.rmtree(store.dir(forced))
    rerun = store.run("eval", 1, {}, [], _writer(6.0, calls))
    assert not rerun.skipped and len(calls) == 3


def test_failed_run_keeps_done_shards_and_resumes(tmp_path: Path) -> None:
    store = Store(tmp_path)
    seen: list[list[int]] = []

    def make(crash_after: int | None):
        def fn(ctx: StageContext) -> None:
            done = ctx.done_shards()
            seen.append(sorted(done))
            for i in range(4):
                if i in done:
                    continue
                if crash_after is not None and i == crash_after:
                    raise RuntimeError("worker died")
                ids = list(range(i * 10, i * 10 + 10))
                ctx.write_shard(i, _evals(float(i), n=10, offset=i * 10).set_column(
                    0, "run_id", pa.array([str(x) for x in ids])))
        return fn

    with pytest.raises(RuntimeError, match="worker died"):
        store.run("eval", 1, {"shards": 4}, [], make(crash_after=2))
    (failed,) = store.catalog.artifacts("eval")
    assert failed.status == "failed" and "worker died" in failed.error
    assert sorted(done_shards(store.dir(failed))) == [0, 1]
    assert store.latest("eval") is None

    result = store.run("eval", 1, {"shards": 4}, [], make(crash_after=None))
    assert seen == [[], [0, 1]]
    assert not result.skipped and result.id == failed.id
    assert result.status == "complete" and result.rows == 40
    assert result.bytes == sum(p.stat().st_size for p in store.dir(result).iterdir())
    table = store.table(result)
    assert sorted(int(x) for x in table.column("run_id").to_pylist()) == list(range(40))
    assert (result.finished_at - result.started_at).total_seconds() >= 0

    with pytest.raises(RuntimeError, match="worker died"):  # crashes again, at shard 1 this time
        store.run("eval", 1, {"shards": 4}, [], make(crash_after=1), force=True)
    assert sorted(done_shards(store.dir(failed))) == [0]
    store.run("eval", 1, {"shards": 4}, [], make(crash_after=None), force=True)  # forced: afresh, not resumed
    assert seen[2:] == [[], []]


def test_siblings_are_the_same_stage_code_and_config_over_other_inputs(tmp_path: Path) -> None:
    """A stage may take over parts of another run's output only when that run's fingerprint,
    recomputed with this code version, matches: same stage, code and config, other inputs."""
    store = Store(tmp_path)

    def write(value: float):
        return lambda ctx: ctx.write_shard(0, _evals(value))

    a, b = (store.run("eval", 1, {"value": v}, [], write(v)) for v in (1.0, 2.0))
    one = store.run("eval", 1, {"k": 1}, [a], write(3.0))
    two = store.run("eval", 1, {"k": 1}, [b], write(4.0))
    store.run("eval", 1, {"k": 2}, [b], write(5.0))  # another config
    assert [(s.id, [i.id for i in inputs]) for s, inputs in store.siblings(two, 1)] == [(one.id, [a.id])]
    assert store.siblings(two, 2) == []  # the others were written by another code version
    shutil.rmtree(store.dir(one))
    assert store.siblings(two, 1) == []  # a sibling without its files offers nothing


def test_stage_shards_are_validated_against_the_stage_table(tmp_path: Path) -> None:
    store = Store(tmp_path)

    def bad(ctx: StageContext) -> None:
        ctx.write_shard(0, _evals(1.0).drop_columns(["metric"]))

    with pytest.raises(ValueError, match="metric"):
        store.run("eval", 1, {}, [], bad)
    assert store.catalog.artifacts("eval")[0].status == "failed"
    assert done_shards(store.dir(store.catalog.artifacts("eval")[0])) == {}


# --- shards ------------------------------------------------------------------------------

def test_shards_read_in_index_order_and_ignore_temp_files(tmp_path: Path) -> None:
    for i in (2, 0, 1):
        write_shard(tmp_path, i, pa.table({"x": [i, i]}))
    (tmp_path / ".part-00003.parquet.abc.tmp").write_bytes(b"partial")
    assert sorted(done_shards(tmp_path)) == [0, 1, 2]
    assert read_table(tmp_path).column("x").to_pylist() == [0, 0, 1, 1, 2, 2]
    assert count_rows(tmp_path) == 6


def test_truncated_shard_raises_store_error_naming_file(tmp_path: Path) -> None:
    store = Store(tmp_path)
    art = store.run("eval", 1, {}, [], _writer(1.0))
    shard = store.dir(art) / "part-00000.parquet"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(StoreError, match="part-00000.parquet"):
        count_rows(store.dir(art))
    with pytest.raises(StoreError, match="part-00000.parquet"):
        query(tmp_path, "SELECT * FROM evals")
    with pytest.raises(StoreError, match="part-00000.parquet") as info:
        store.table(art)
    assert info.value.path == shard
    assert store.catalog.get(art.id).status == "failed"  # the next run recomputes it


# --- SQL views ---------------------------------------------------------------------------

def test_views_show_latest_complete_version_with_relative_paths(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = Store(root)
    store.run("eval", 1, {"v": 1}, [], _writer(1.0))
    store.run("eval", 1, {"v": 2}, [], _writer(2.0))

    def crash(ctx: StageContext) -> None:
        ctx.write_shard(0, _evals(3.0))
        raise RuntimeError("crash after writing")

    with pytest.raises(RuntimeError):
        store.run("eval", 1, {"v": 3}, [], crash)

    def train(ctx: StageContext) -> None:
        ctx.write_file("cartridge.bin", b"\0" * 8)
        steps = pa.table({
            "run_id": ["r", "r"], "step": [1, 2], "docs": [["a"], ["a"]],
            "visibility": ["iso", "iso"], "loss": [0.9, 0.7], "lr": [1e-3, 1e-3],
            "tokens": [5, 5], "seconds": [0.1, 0.1], "heldout_loss": [None, 0.8],
        })
        ctx.write_shard(0, steps, table="train_steps")

    trained = store.run("train", 1, {}, [], train)
    assert trained.rows == 2

    cols, rows = query(root, "SELECT value, count(*) AS n FROM evals GROUP BY value")
    assert (cols, rows) == (["value", "n"], [(2.0, 3)])
    _, rows = query(root, "SELECT step, loss FROM train_steps ORDER BY step")
    assert rows == [(1, 0.9), (2, 0.7)]
    store.run("plan", 1, {}, [], lambda ctx: ctx.write_shard(0, pa.table({"round": [0, 1]})))
    assert query(root, "SELECT sum(round) FROM plan")[1] == [(1,)]
    _, rows = query(root, "SELECT status, count(*) FROM artifacts GROUP BY status ORDER BY 1")
    assert rows == [("complete", 4), ("failed", 1)]

    moved = tmp_path / "elsewhere"
    shutil.copytree(root, moved)
    shutil.rmtree(root)
    _, rows = query(moved, "SELECT DISTINCT value FROM evals")
    assert rows == [(2.0,)]


def test_query_errors_are_store_errors(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no runs"):
        query(tmp_path, "SELECT 1")
    store = Store(tmp_path)
    store.run("eval", 1, {}, [], _writer(1.0))
    with pytest.raises(StoreError, match="(?i)syntax"):
        query(tmp_path, "SELEC nonsense")
    with pytest.raises(StoreError, match="conversations.*synthesize"):
        query(tmp_path, "SELECT * FROM conversations")
    with pytest.raises(StoreError, match="read-only"):
        query(tmp_path, "DELETE FROM artifacts")
    assert len(store.catalog.artifacts()) == 1


def test_catalog_is_readable_from_another_process_between_writes(tmp_path: Path) -> None:
    store = Store(tmp_path)
    run_id = store.catalog.start_run("cartridge")
    store.run("eval", 1, {}, [], _writer(4.0), run_id=run_id)
    code = textwrap.dedent(f"""
        import duckdb
        con = duckdb.connect({str(tmp_path / CATALOG_FILE)!r}, read_only=True)
        print(con.execute("SELECT stage, status, rows FROM artifacts").fetchall())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[('eval', 'complete', 3)]"
    store.catalog.finish_run(run_id, "complete", {"loss": 0.5})
    reader = Catalog(tmp_path, read_only=True)
    assert [a.stage for a in reader.artifacts()] == ["eval"]
    (run,) = reader.runs()
    assert (run["run_id"], run["status"], run["summary"]) == (run_id, "complete", {"loss": 0.5})
    assert run["finished_at"] >= run["started_at"]
    assert store.catalog.artifacts()[0].run_id == run_id


def test_non_duckdb_catalog_file_raises_naming_it(tmp_path: Path) -> None:
    (tmp_path / CATALOG_FILE).write_bytes(b"this is not a database\n" * 200)
    with pytest.raises(StoreError, match=CATALOG_FILE):
        Store(tmp_path)
    with pytest.raises(StoreError, match=CATALOG_FILE):
        query(tmp_path, "SELECT 1")


def test_newer_catalog_version_is_refused(tmp_path: Path) -> None:
    Store(tmp_path)
    con = duckdb.connect(str(tmp_path / CATALOG_FILE))
    con.execute("UPDATE meta SET value = '99' WHERE key = 'catalog_version'")
    con.close()
    with pytest.raises(StoreError, match=r"catalog\.duckdb.*version 99"):
        Store(tmp_path)
    with pytest.raises(StoreError, match="version 99"):
        query(tmp_path, "SELECT 1")


def test_gc_removes_superseded_and_failed_but_keeps_inputs(tmp_path: Path) -> None:
    store = Store(tmp_path)
    old = store.run("eval", 1, {"v": 1}, [], _writer(1.0))
    used = store.run("index", 1, {}, [old], lambda ctx: None)
    new = store.run("eval", 1, {"v": 2}, [], _writer(2.0))
    with pytest.raises(ZeroDivisionError):
        store.run("eval", 1, {"v": 3}, [], lambda ctx: 1 / 0)
    failed = [a for a in store.catalog.artifacts() if a.status == "failed"][0]
    assert store.gc(keep=1, dry_run=True) == [failed.id]
    assert store.gc(keep=1) == [failed.id]
    assert not store.dir(failed).exists()
    newer_index = store.run("index", 1, {}, [new], lambda ctx: None)
    assert set(store.gc(keep=1)) == {used.id, old.id}
    assert not store.dir(old).exists() and store.dir(new).is_dir()
    assert {a.id for a in store.catalog.artifacts()} == {new.id, newer_index.id}


def test_format_table_aligns_and_truncates() -> None:
    text = format_table(["name", "n"], [("a" * 50, 3), ("b\nc", None)], max_width=10)
    lines = text.splitlines()
    assert lines[0] == "name" + " " * 6 + "  " + "   n"
    assert lines[1] == "-" * 10 + "  " + "-" * 4
    assert lines[2] == "aaaaaaaaa…" + "  " + "   3"
    assert lines[3] == "b⏎c" + " " * 7 + "  " + "NULL"
    assert lines[-1] == "(2 rows)"
    assert len({len(line) for line in lines[:3]}) == 1


def test_store_root_defaults_to_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CARTRIDGES_HOME", str(tmp_path / "home"))
    assert Store().root == (tmp_path / "home").resolve()
    assert (tmp_path / "home" / CATALOG_FILE).is_file()
    monkeypatch.delenv("CARTRIDGES_HOME")
    monkeypatch.chdir(tmp_path)
    assert Store().root == (tmp_path / "artifacts").resolve()
    assert pq.read_metadata  # pyarrow.parquet is importable for shard inspection
