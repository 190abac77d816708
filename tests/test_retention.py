"""Retention: `cartridges store usage` and `store prune`, and a store that stays bounded under retraining."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from cartridges.fleet import Fleet
from cli.main import main
from jobs.retrain import run_retrain
from schemas.presets import fleet_preset
from storage import Store
from storage.retention import tree_bytes
from storage.versions import current, new_version, publish, version_dirs
from tests.test_fleet_run import quiet, write_docs
from tests.tiny import tiny_llama

pytestmark = pytest.mark.reliability
CYCLES = 20


def test_twenty_retrain_cycles_with_changing_documents_keep_the_disk_bounded(tmp_path):
    lm = tiny_llama()
    docs, root, store = write_docs(tmp_path / "docs"), tmp_path / "fleet", Store(tmp_path / "store")
    cfg = fleet_preset("smoke", {"rounds": 1, "heldout": 0})
    sizes, counts = [], []
    for cycle in range(CYCLES):
        (docs / f"d{cycle % 3}.md").write_text(f"edition {cycle}: the clock tower strikes {cycle} times. " * 12)
        s = run_retrain(store, lm, [docs], root, cfg, log=quiet)
        assert s["published"] and s["version"] == f"{cycle + 1:04d}"
        sizes.append(tree_bytes(store.root) + tree_bytes(root))
        counts.append(len(store.catalog.artifacts()))
        assert len(version_dirs(root)) <= 3
    assert [v.name for v in version_dirs(root)] == ["0018", "0019", "0020"]
    assert current(root) == (root / "versions" / "0020").resolve()
    assert Fleet.open(root, lm).names == ["d0.md", "d1.md", "d2.md"]
    # Bounded: the second half of the cycles uses no more than the first half's peak (plus the
    # catalog's own slack), and the artifact count stops growing.
    assert max(sizes[10:]) <= 1.15 * max(sizes[:10]), sizes
    assert max(counts[5:]) <= max(counts[:5]) + 2, counts
    (tmp_path / "sizes.json").write_text(json.dumps({"bytes": sizes, "artifacts": counts}))
    print(f"store+fleet bytes per cycle: {sizes}; artifacts: {counts}")


def _rows(ctx, n: int = 2) -> None:
    ctx.write_shard(0, pa.table({"x": list(range(n))}), validate=False)


def test_usage_and_prune_keep_what_is_referenced(tmp_path, capsys):
    store = Store(tmp_path / "store")
    old = store.run("ingest_like", 1, {"v": 1}, [], _rows)
    used = store.run("chunks_like", 1, {"v": 1}, [], _rows)
    result = store.run("eval", 1, {"v": 1}, [used], _rows)  # a record: it and its input stay
    new = store.run("ingest_like", 1, {"v": 2}, [], _rows)
    with pytest.raises(RuntimeError):
        store.run("ingest_like", 1, {"v": 3}, [], lambda ctx: (_rows(ctx), (_ for _ in ()).throw(RuntimeError("x"))))
    running = store.catalog.begin("chunks_like", "f" * 64, [old.id], {"v": 9})  # a writer is on it: stays
    store.dir(running).mkdir(parents=True)
    superseded = store.run("chunks_like", 1, {"v": 0}, [], _rows)
    later = store.run("chunks_like", 1, {"v": 2}, [], _rows)
    root = tmp_path / "fleet"
    for i in range(5):
        v = new_version(root)
        (v / "fleet.json").write_text(json.dumps({"n": i}))
        publish(root, v)
    (new_version(root) / "half").write_text("a build that died")  # 0006: never published

    args = ["--store", str(store.root), "--fleet", str(root)]
    assert main(["store", "usage", *args, "--json"]) == 0
    u = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert u["stages"]["ingest_like"]["artifacts"] == 3 and u["stages"]["ingest_like"]["failed"] == 1
    assert [v["version"] for v in u["fleets"][0]["versions"]] == ["0001", "0002", "0003", "0004", "0005", "0006"]
    assert u["bytes"] > 0 and u["fleets"][0]["bytes"] > 0

    before = {a.id for a in store.catalog.artifacts()}
    assert main(["store", "prune", *args, "--keep", "2", "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {a.id for a in store.catalog.artifacts()} == before and len(version_dirs(root)) == 6  # nothing removed
    assert main(["store", "prune", *args, "--keep", "2", "--json"]) == 0
    done = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["artifacts"] == done["artifacts"] and plan["versions"] == done["versions"]
    assert done["versions"] == {str(root.resolve()): ["0001", "0002", "0003", "0006"]}
    assert [v.name for v in version_dirs(root)] == ["0004", "0005"] and current(root).name == "0005"
    left = {a.id for a in store.catalog.artifacts()}
    assert left == {old.id, used.id, result.id, new.id, running.id, later.id}  # old feeds the running one
    assert superseded.id in done["artifacts"] and not store.dir(superseded).exists()
    assert all(store.dir(a).is_dir() for a in store.catalog.artifacts())
    assert main(["store", "prune", *args, "--keep", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: --keep must be at least 1")
