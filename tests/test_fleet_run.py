"""Whole fleet runs on a tiny model: coverage, resume, incremental updates, damage, and the Prefect flow."""

from __future__ import annotations

import json

import pytest
import torch

from cartridges.core.errors import FleetError
from cartridges.core.health import training_health
from cartridges.fleet import Fleet
from cartridges.fleet.manifest import read_manifest
from jobs.fleet import run_fleet
from schemas.presets import fleet_preset
from storage import Store, query
from tests.tiny import tiny_llama

WORDS = ["apples grow in orchards", "rockets fly to orbit", "rivers run to the sea",
         "castles have tall towers", "bread needs flour and yeast"]


def write_docs(directory, n=3, words=WORDS):
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (directory / f"d{i}.md").write_text((words[i] + ". ") * 20)
    return directory


def quiet(_):
    pass


@pytest.fixture(scope="module")
def lm():
    return tiny_llama()


def files_of(directory):
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.name.startswith("doc-")}


def contents_of(directory):
    """Per file: header metadata and raw tensor bytes (safetensors may order header keys differently)."""
    from safetensors import safe_open

    out = {}
    for p in directory.iterdir():
        if p.name.startswith("doc-"):
            with safe_open(p, "pt") as f:
                out[p.name] = (f.metadata(), {k: f.get_tensor(k).numpy().tobytes() for k in f.keys()})
    return out


def test_balanced_targets_over_five_documents_with_budget_three_cover_them_evenly(tmp_path, lm):
    docs = write_docs(tmp_path / "docs", 5)
    cfg = fleet_preset("smoke", {"p_iso": 1.0, "targets": "balanced", "budget": 3, "rotate_every": 2,
                                 "rounds": 11, "accum": 1, "heldout": 0})
    s = run_fleet(Store(tmp_path / "s"), lm, [docs], tmp_path / "f", cfg, log=quiet)
    steps = [d["steps"] for d in s["documents"]]
    assert sum(steps) == 11 and max(steps) - min(steps) <= 1
    assert all(r["visibility"] == "isolated" for r in s["steps_table"])
    assert len({tuple(r["docs"]) for r in s["steps_table"]}) == 5  # every document was resident at some point


def test_resume_continues_rows_moments_and_counters_exactly(tmp_path, lm):
    docs = write_docs(tmp_path / "docs")
    cfg = fleet_preset("smoke", {"rounds": 6, "p_iso": 0.5})
    one = run_fleet(Store(tmp_path / "s1"), lm, [docs], tmp_path / "one", cfg, log=quiet)
    half = cfg.replace(rounds=3)
    run_fleet(Store(tmp_path / "s2"), lm, [docs], tmp_path / "two", half, log=quiet)
    two = run_fleet(Store(tmp_path / "s2"), lm, [docs], tmp_path / "two", half, resume=True, log=quiet)
    assert two["rounds"] == 6 and one["losses"][3:] == two["losses"]
    a, b = read_manifest(tmp_path / "one"), read_manifest(tmp_path / "two")
    assert [(d.name, d.steps) for d in a.documents] == [(d.name, d.steps) for d in b.documents]
    assert a.residents == b.residents
    assert contents_of(tmp_path / "one") == contents_of(tmp_path / "two")


def test_a_crash_mid_run_resumes_to_the_same_fleet(tmp_path, lm, monkeypatch):
    from storage.faults import InjectedFault

    docs = write_docs(tmp_path / "docs")
    cfg = fleet_preset("smoke", {"rounds": 6})
    run_fleet(Store(tmp_path / "s1"), lm, [docs], tmp_path / "clean", cfg, log=quiet)
    monkeypatch.setenv("CARTRIDGES_FAULT", "fleet.round.4:raise")
    with pytest.raises(InjectedFault):
        run_fleet(Store(tmp_path / "s2"), lm, [docs], tmp_path / "crashed", cfg, log=quiet)
    monkeypatch.delenv("CARTRIDGES_FAULT")
    assert read_manifest(tmp_path / "crashed").rounds == 4  # the checkpoint at the rotation after round 3
    run_fleet(Store(tmp_path / "s2"), lm, [docs], tmp_path / "crashed", cfg.replace(rounds=2), resume=True, log=quiet)
    assert contents_of(tmp_path / "clean") == contents_of(tmp_path / "crashed")


def test_changing_one_of_three_documents_retrains_only_its_cartridge(tmp_path, lm):
    docs = write_docs(tmp_path / "docs")
    cfg = fleet_preset("smoke", {"rounds": 4})
    store, fleet = Store(tmp_path / "s"), tmp_path / "f"
    run_fleet(store, lm, [docs], fleet, cfg, log=quiet)
    before = files_of(fleet)
    steps_before = {d.name: d.steps for d in read_manifest(fleet).documents}
    (docs / "d1.md").write_text("clocks keep the time. " * 20)
    s = run_fleet(store, lm, [docs], fleet, cfg, resume=True, log=quiet)
    after = files_of(fleet)
    m = read_manifest(fleet)
    changed = m.entry("d1.md")
    for name in ("d0.md", "d2.md"):
        e = m.entry(name)
        assert e.steps == steps_before[name]
        assert after[e.cartridge] == before[e.cartridge] and after[e.optimizer] == before[e.optimizer]
    assert changed.cartridge not in before and changed.steps == 4 and changed.doc_id == 1
    assert [d["name"] for d in s["documents"] if d["changed"]] == ["d1.md"]
    d1 = next(d for d in s["documents"] if d["name"] == "d1.md")  # trained this run: checked
    assert d1["health_reason"] == training_health([], d1["heldout_before"], d1["heldout_after"])
    assert all("health_reason" not in d for d in s["documents"] if not d["trained"])
    assert {d for r in s["steps_table"] for d in r["docs"]} == {"d1.md"}
    # a removed document leaves the fleet and its files go
    (docs / "d2.md").unlink()
    run_fleet(store, lm, [docs], fleet, cfg.replace(rounds=0), resume=True, log=quiet)
    m = read_manifest(fleet)
    assert [d.name for d in m.documents] == ["d0.md", "d1.md"]
    assert not [n for n in files_of(fleet) if n.startswith("doc-002")]
    assert set(Fleet.open(fleet, lm).index().chunk_docs) == {"d0.md", "d1.md"}


def build_fleet(root, lm):
    """A smoke fleet of three documents under `root` (fleet in `root / "f"`)."""
    docs = write_docs(root / "docs")
    run_fleet(Store(root / "s"), lm, [docs], root / "f", fleet_preset("smoke"), log=quiet)
    return root


def copy_fleet(built, tmp_path):
    """A copy of a built fleet to damage."""
    import shutil

    target = tmp_path / "f"
    shutil.copytree(built / "f", target)
    return target


@pytest.fixture(scope="module")
def built(tmp_path_factory, lm):
    return build_fleet(tmp_path_factory.mktemp("built"), lm)


@pytest.mark.parametrize("damage, message", [
    (lambda f: (f / "fleet.json").write_text("{not json"), "not valid JSON"),
    (lambda f: (f / "fleet.json").write_text(json.dumps({"format": "other"})), "not a fleet manifest"),
    (lambda f: (f / "fleet.json").write_text(
        json.dumps({k: v for k, v in json.loads((f / "fleet.json").read_text()).items() if k != "documents"})),
     "missing field 'documents'"),
    (lambda f: (f / "fleet.json").unlink(), "no fleet manifest"),
])
def test_a_damaged_manifest_is_a_clear_error(built, tmp_path, lm, damage, message):
    fleet = copy_fleet(built, tmp_path)
    damage(fleet)
    with pytest.raises(FleetError, match=message):
        Fleet.open(fleet, lm)


def test_damaged_swapped_or_foreign_files_are_clear_errors(built, tmp_path, lm):
    fleet = copy_fleet(built, tmp_path)
    m = read_manifest(fleet)
    a, b = m.documents[0], m.documents[1]
    data = (fleet / a.cartridge).read_bytes()
    (fleet / a.cartridge).write_bytes(data[: len(data) // 2])
    with pytest.raises(FleetError, match="d0.md.*corrupted"):
        Fleet.open(fleet, lm).rows([a.name])
    (fleet / a.cartridge).write_bytes((fleet / b.cartridge).read_bytes())
    with pytest.raises(FleetError, match="holds document 'd1.md'"):
        Fleet.open(fleet, lm).rows([a.name])
    (fleet / a.cartridge).write_bytes(data)
    raw = bytearray((fleet / "index.faiss").read_bytes())
    raw[-5] ^= 0xFF
    (fleet / "index.faiss").write_bytes(bytes(raw))
    with pytest.raises(FleetError, match="checksum mismatch"):
        Fleet.open(fleet, lm).select("apples")
    with pytest.raises(FleetError, match="another model"):
        Fleet.open(fleet, tiny_llama(seed=1))
    with pytest.raises(FleetError, match="not in this fleet"):
        Fleet.open(fleet, lm).rows(["nope.md"])


def test_public_api_selects_and_composes(built, lm):
    fleet = Fleet.open(built / "f", lm)
    assert fleet.names == ["d0.md", "d1.md", "d2.md"]
    picked = fleet.select("rockets fly to orbit. rockets fly to orbit.", k=2)
    assert 1 <= len(picked) <= 2 and set(picked) <= set(fleet.names)
    rows = fleet.rows(["d2.md", "d0.md"])
    c2, c0 = fleet.cartridge("d2.md"), fleet.cartridge("d0.md")
    assert rows[0][0].shape[1] == c2.p + c0.p == 32
    assert torch.equal(rows[0][0][:, :16], c2.rows()[0][0]) and torch.equal(rows[0][0][:, 16:], c0.rows()[0][0])


def test_fleet_flow_through_prefect_cli_then_sql_ask_and_index_rebuild(tmp_path, tiny_model_dir, capsys):
    from cli.main import main

    docs = write_docs(tmp_path / "docs")
    store, fleet = tmp_path / "store", tmp_path / "fleet"
    common = ["--model", str(tiny_model_dir), "--fleet", str(fleet), "--store", str(store), "--preset", "smoke"]
    assert main(["fleet", "--docs", str(docs), *common, "--rounds", "3", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["rounds"] == 3 and len(summary["documents"]) == 3 and summary["index_chunks"] > 0
    _, rows = query(store, "select step, visibility, len(docs) from train_steps order by step")
    assert [r[0] for r in rows] == [0, 1, 2]
    assert all(v == "isolated" if n == 1 else v.startswith("co-loaded:") for _, v, n in rows)

    assert main(["ask", "--model", str(tiny_model_dir), "--fleet", str(fleet), "rockets fly to orbit?",
                 "--max-new", "4", "--rag-docs", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["selected"]) == 1 and len(out["scores"]) == 1 and "answer" in out
    assert main(["ask", "--model", str(tiny_model_dir), "--fleet", str(fleet), "anything", "--oracle", "d2.md",
                 "--max-new", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["selected"] == ["d2.md"]

    carts = files_of(fleet)
    (fleet / "index.faiss").unlink()
    assert main(["fleet", "--docs", str(docs), *common, "--rounds", "0", "--resume", "--no-prefect"]) == 0
    assert (fleet / "index.faiss").is_file() and files_of(fleet) == carts
    assert read_manifest(fleet).rounds == 3
    capsys.readouterr()
    assert main(["fleet", "--docs", str(docs), *common]) == 2  # exists: needs --resume
    err = capsys.readouterr().err.strip()
    assert "--resume" in err and len(err.splitlines()) == 1
