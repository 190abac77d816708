"""Damaged files: truncated, bit-flipped or of the wrong type, each caught with an error naming the file.

Cartridge and optimizer files (every bit position of a tiny file flipped), Parquet shards,
fleet manifests and the catalog. Where the damaged thing can be recomputed (a stage's
shards), the store recomputes it instead of trusting it; a full disk (an injected ENOSPC)
leaves every earlier artifact and the fleet's last consistent state intact.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from cartridges.core.errors import CartridgeError, CartridgeFileError, FleetError
from cartridges.core.files import check_fits, load_cartridge, load_optimizer, save_optimizer
from cartridges.core.train import make_optimizer
from cartridges.fleet import Fleet
from cartridges.fleet.manifest import read_manifest
from jobs.fleet import run_fleet
from schemas import TABLES
from schemas.presets import fleet_preset
from storage import Store, StoreError, shards
from storage.faults import ENV
from tests.crash import check_store, fleet_state
from tests.serving import write_cartridge
from tests.test_fleet_run import build_fleet, copy_fleet, quiet, write_docs
from tests.tiny import tiny_llama

pytestmark = pytest.mark.reliability


@pytest.fixture(scope="module")
def lm():
    return tiny_llama()


def flipped(data: bytes, pos: int, bit: int = 0x01) -> bytes:
    out = bytearray(data)
    out[pos] ^= bit
    return bytes(out)


def damages(data: bytes) -> list[tuple[str, bytes]]:
    """Truncations at telling lengths and wrong-type contents."""
    cuts = sorted({0, 1, 7, 8, 9, 64, len(data) // 2, len(data) - 2})
    return [(f"truncated to {n} bytes", data[:n]) for n in cuts] + [
        ("random bytes", bytes(range(256)) * 8),
        ("a JSON file", b'{"format": "cartridges"}'),
        ("text", b"hello, this is not a tensor file\n" * 10),
        ("a header claiming 2**63 bytes", b"\x00\x00\x00\x00\x00\x00\x00\x80{}"),
        ("a JSON list as header", b"\x02\x00\x00\x00\x00\x00\x00\x00[]"),
    ]


# --- cartridge and optimizer files ------------------------------------------------------

@pytest.fixture(scope="module")
def files(tmp_path_factory, lm):
    root = tmp_path_factory.mktemp("files")
    cart_path = write_cartridge(lm, root / "c.safetensors")
    cart = load_cartridge(cart_path)
    opt = make_optimizer(cart, 1e-3)
    for group in opt.param_groups:  # one step, so the file holds moments
        for param in group["params"]:
            param.grad = torch.ones_like(param)
    opt.step()
    opt_path = save_optimizer(root / "c.adam.safetensors", opt, 3, corpus_sha256="x", document="d")
    return root, cart_path, opt_path


def flip_positions(data: bytes, stride: int = 7) -> list[int]:
    """Every byte of the safetensors header, every `stride`-th byte of the tensor data."""
    head = 8 + int.from_bytes(data[:8], "little")
    return list(range(head)) + list(range(head, len(data), stride))


def load_cart(lm, path: Path) -> None:
    check_fits(load_cartridge(path), lm.fingerprint, str(path))


def load_opt(lm, cart_path: Path, path: Path) -> None:
    load_optimizer(path, make_optimizer(load_cartridge(cart_path), 1e-3))


@pytest.mark.parametrize("kind", ["cartridge", "optimizer"])
def test_single_bit_flips_anywhere_in_a_file_are_caught(files, lm, tmp_path, kind):
    _, cart_path, opt_path = files
    source = cart_path if kind == "cartridge" else opt_path
    data = source.read_bytes()
    target = tmp_path / source.name
    loader = (lambda: load_cart(lm, target)) if kind == "cartridge" else (lambda: load_opt(lm, cart_path, target))
    for pos in flip_positions(data):
        target.write_bytes(flipped(data, pos, 0x80 if pos % 2 else 0x01))
        with pytest.raises(CartridgeError, match=str(target).replace(".", r"\.")):
            loader()


@pytest.mark.parametrize("kind", ["cartridge", "optimizer"])
def test_truncated_and_wrong_type_files_are_caught(files, lm, tmp_path, kind):
    _, cart_path, opt_path = files
    source = cart_path if kind == "cartridge" else opt_path
    other = opt_path if kind == "cartridge" else cart_path
    target = tmp_path / source.name
    loader = (lambda: load_cart(lm, target)) if kind == "cartridge" else (lambda: load_opt(lm, cart_path, target))
    cases = damages(source.read_bytes()) + [("the other kind of file", other.read_bytes())]
    for what, data in cases:
        target.write_bytes(data)
        with pytest.raises(CartridgeFileError, match=str(target).replace(".", r"\.")):
            loader()
        assert what
    target.unlink()
    target.mkdir()
    with pytest.raises(CartridgeFileError, match="no such"):
        loader()


# --- Parquet shards and the store -------------------------------------------------------

def steps_table(n: int = 20, first: int = 0) -> pa.Table:
    rows = [{"step": i, "docs": ["a.md", "b.md"], "visibility": "isolated", "loss": 0.5 + i, "lr": 1e-3,
             "tokens": 100 + i, "seconds": 0.1, "heldout_loss": None, "run_id": "r"} for i in range(first, first + n)]
    return pa.Table.from_pylist(rows, schema=TABLES["train_steps"])


def test_every_single_bit_flip_in_a_shard_is_caught_or_harmless(tmp_path):
    table = steps_table()
    path = shards.write_shard(tmp_path, 0, table)
    data = path.read_bytes()
    harmless = 0
    for pos in range(len(data)):
        path.write_bytes(flipped(data, pos))
        try:
            got = shards.read_shard(path, TABLES["train_steps"])
        except StoreError as e:
            assert str(path) in str(e)
            continue
        assert got.equals(table), f"a flip at byte {pos} of {len(data)} changed values silently"
        harmless += 1  # statistics and other footer fields that do not change the data
    assert harmless < len(data) // 2


def test_truncated_and_wrong_type_shards_name_the_file(tmp_path):
    path = shards.write_shard(tmp_path, 0, steps_table())
    data = path.read_bytes()
    wrong_schema = tmp_path / "other"
    other = shards.write_shard(wrong_schema, 0, pa.table({"x": [1, 2]}))
    for _what, bad in damages(data) + [("another table's shard", other.read_bytes())]:
        path.write_bytes(bad)
        with pytest.raises(StoreError, match=str(path).replace(".", r"\.")):
            shards.read_shard(path, TABLES["train_steps"])


def breaking_flip(path: Path, probe: Path) -> bytes:
    """The shard's bytes with the first single-bit flip (past the magic) that makes it unreadable."""
    data = path.read_bytes()
    for pos in range(4, len(data)):
        probe.write_bytes(flipped(data, pos, 0x08))
        try:
            shards.read_shard(probe)
        except StoreError:
            return probe.read_bytes()
    raise AssertionError("no flip breaks the shard")


def stage(store: Store, calls: list):
    def work(ctx) -> None:
        calls.append(1)
        for i in range(3):
            ctx.write_shard(i, steps_table(4, 4 * i), table="train_steps")

    return store.run("steps_demo", 1, {"n": 3}, [], work)


@pytest.mark.parametrize("damage", ["truncate", "flip", "wrong type", "delete"])
def test_a_damaged_shard_of_a_complete_artifact_is_recomputed(tmp_path, damage, capfd):
    store, calls = Store(tmp_path), []
    art = stage(store, calls)
    good = store.table(art, "train_steps")
    path = store.dir(art) / "train_steps" / "part-00001.parquet"
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) - 10])
    elif damage == "flip":  # same size: only the page checksum can tell
        path.write_bytes(breaking_flip(path, tmp_path / "probe.parquet"))
    elif damage == "wrong type":
        path.write_bytes(json.dumps({"not": "parquet"}).encode().ljust(len(data)))
    else:
        path.unlink()
    if damage == "flip":
        assert stage(store, calls).skipped  # sizes and footers agree: reused until read ...
        with pytest.raises(StoreError, match=r"part-00001\.parquet.*marked failed"):
            store.table(art, "train_steps")  # ... and reading it marks it failed
        assert store.catalog.get(art.id).status == "failed"
    again = stage(store, calls)
    assert not again.skipped and len(calls) == 2
    assert store.table(again, "train_steps").equals(good)
    if damage != "flip":
        assert "running stage steps_demo again" in capfd.readouterr().err
    check_store(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "flip", "a Parquet file"])
def test_a_damaged_catalog_is_a_clear_error(tmp_path, damage):
    store = Store(tmp_path / "s")
    stage(store, [])
    path = store.catalog.path
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[:1000])
    elif damage == "garbage":
        path.write_bytes(b"\x00garbage" * 1000)
    elif damage == "flip":  # every block: a flip in any of them is reported
        for pos in range(4096 * 3 + 100, len(data), 4096):
            data = flipped(data, pos, 0x10)
        path.write_bytes(data)
    else:
        path.write_bytes(shards.write_shard(tmp_path / "p", 0, steps_table()).read_bytes())
    with pytest.raises(StoreError, match=f"{path}.*move it aside"):
        s = Store(tmp_path / "s")
        s.catalog.artifacts()
        Store(tmp_path / "s", read_only=True).catalog.artifacts()


# --- fleets: manifests, checkpoint files, a full disk ---------------------------------------

@pytest.fixture(scope="module")
def built(tmp_path_factory, lm):
    return build_fleet(tmp_path_factory.mktemp("fleet"), lm)


def test_manifest_bit_flips_truncation_and_wrong_type_are_caught(built, tmp_path, lm):
    fleet = copy_fleet(built, tmp_path)
    path = fleet / "fleet.json"
    data = path.read_bytes()
    text = data.decode()
    digits = [i for i, ch in enumerate(text) if ch.isdigit()]
    for pos in digits[:: max(1, len(digits) // 60)] + list(range(0, len(data), 97)):
        path.write_bytes(flipped(data, pos))
        with pytest.raises(FleetError, match=str(path).replace(".", r"\.")):
            read_manifest(fleet)
    m = read_manifest(built / "f")
    for _what, bad in damages(data) + [("a cartridge file", (built / "f" / m.documents[0].cartridge).read_bytes())]:
        path.write_bytes(bad)
        with pytest.raises(FleetError, match=str(path).replace(".", r"\.")):
            Fleet.open(fleet, lm)


def test_damaged_checkpoint_files_stop_a_resume_naming_the_file(built, tmp_path, lm):
    fleet = copy_fleet(built, tmp_path)
    m = read_manifest(fleet)
    cfg = fleet_preset("smoke", {"rounds": 2})
    for name in (m.documents[0].cartridge, m.documents[1].optimizer):
        good = (fleet / name).read_bytes()
        (fleet / name).write_bytes(flipped(good, len(good) - 3))
        with pytest.raises(FleetError, match=rf"{name.replace('.', '[.]')}.*corrupted"):
            run_fleet(Store(tmp_path / "s"), lm, [built / "docs"], fleet, cfg, resume=True, log=quiet)
        (fleet / name).write_bytes(good)
        opened = Fleet.open(fleet, lm)  # what the run saved before it stopped is consistent
        opened.rows(opened.names)


def test_a_corrupt_round_artifact_is_recomputed_by_the_next_run(built, tmp_path, lm):
    store_root = tmp_path / "s"
    shutil.copytree(built / "s", store_root)
    store = Store(store_root)
    art = next(a for a in store.catalog.artifacts("fleet_round") if a.config["round"] == 0)
    shard = store.dir(art) / "targets" / "part-00000.parquet"
    shard.write_bytes(breaking_flip(shard, tmp_path / "probe.parquet"))
    cfg = fleet_preset("smoke")
    with pytest.raises(StoreError, match=r"targets/part-00000\.parquet.*marked failed"):
        run_fleet(store, lm, [built / "docs"], tmp_path / "f1", cfg, log=quiet)
    shutil.rmtree(tmp_path / "f1")
    run_fleet(store, lm, [built / "docs"], tmp_path / "f1", cfg, log=quiet)
    assert fleet_state(tmp_path / "f1") == fleet_state(built / "f")
    assert store.catalog.get(art.id).status == "complete"


@pytest.mark.parametrize("where", ["atomic.write.*.adam.safetensors@3", "atomic.write.part-*@6",
                                   "atomic.write.fleet.json@3"])
def test_a_full_disk_loses_nothing_already_written(built, tmp_path, lm, monkeypatch, where):
    store_root, fleet = tmp_path / "s", tmp_path / "f"
    cfg = fleet_preset("smoke")
    monkeypatch.setenv(ENV, f"{where}:enospc")
    with pytest.raises(OSError) as info:
        run_fleet(Store(store_root), lm, [built / "docs"], fleet, cfg, log=quiet)
    assert info.value.errno == errno.ENOSPC
    monkeypatch.delenv(ENV)
    check_store(store_root)  # every complete artifact whole
    assert not [p for p in fleet.rglob(".*.tmp")]  # no half-written file left
    if (fleet / "fleet.json").exists():  # the last consistent fleet still opens and loads
        opened = Fleet.open(fleet, lm)
        opened.rows(opened.names)
        resume, rounds = True, cfg.rounds - read_manifest(fleet).rounds
    else:
        resume, rounds = False, cfg.rounds
    run_fleet(Store(store_root), lm, [built / "docs"], fleet, cfg.replace(rounds=rounds), resume=resume, log=quiet)
    assert fleet_state(fleet) == fleet_state(built / "f")


def test_the_cli_reports_a_full_disk_in_one_line(tmp_path, tiny_model_dir, monkeypatch, capsys):
    from cli.main import main

    docs = write_docs(tmp_path / "docs")
    monkeypatch.setenv(ENV, "atomic.write.part-00000.parquet:enospc")
    code = main(["fleet", "--docs", str(docs), "--model", str(tiny_model_dir), "--fleet", str(tmp_path / "f"),
                 "--store", str(tmp_path / "s"), "--preset", "smoke", "--no-prefect"])
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ")
    assert "No space left on device" in err[0] and "rerun" in err[0]
    assert Store(tmp_path / "s").catalog.artifacts("ingest")[0].status == "failed"
