"""Cartridge files: bitwise roundtrip, and clear errors for wrong models and damaged files."""

from __future__ import annotations

import pytest
import torch

from cartridges.core.cartridge import Cartridge
from cartridges.core.errors import CartridgeFileError, GeometryError
from cartridges.core.files import check_fits, load_cartridge, save_cartridge
from cartridges.core.prefix import capture_rows
from tests.tiny import tiny_llama, tiny_qwen3


def make(lm, p=6, frozen=1):
    ids = torch.arange(p) + 40
    return Cartridge.from_rows(capture_rows(lm.model, ids), frozen=frozen)


def test_save_load_roundtrip_is_bitwise(tmp_path):
    lm = tiny_llama()
    cart = make(lm, frozen=2)
    with torch.no_grad():
        cart.train_keys[0].add_(0.25)  # trained rows, not just a capture
    draft = torch.arange(100, dtype=torch.int64)
    path = save_cartridge(tmp_path / "c.safetensors", cart, lm.fingerprint, steps=7, corpus_sha256="ab", draft_reference=draft)
    back = load_cartridge(path)
    assert back.p == cart.p and back.frozen == 2 and back.geometry == cart.geometry
    for (k1, v1), (k2, v2) in zip(cart.detached_rows(), back.detached_rows(), strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert back.meta["steps"] == 7 and back.meta["corpus_sha256"] == "ab"
    assert torch.equal(back.meta["draft_reference"], draft)
    assert back.meta["model_fingerprint"] == lm.fingerprint
    check_fits(back, lm.fingerprint)
    assert not list(tmp_path.glob(".*tmp"))


def test_cartridge_for_another_model_names_both_geometries(tmp_path):
    qwen, llama = tiny_qwen3(layers=3), tiny_llama()
    path = save_cartridge(tmp_path / "q.safetensors", make(qwen), qwen.fingerprint)
    with pytest.raises(GeometryError) as err:
        check_fits(load_cartridge(path), llama.fingerprint, str(path))
    msg = str(err.value)
    assert "3 layers x 2x8" in msg and "2 layers x 2x8" in msg and "q.safetensors" in msg


def test_same_geometry_other_weights_is_rejected(tmp_path):
    a, b = tiny_llama(seed=0), tiny_llama(seed=1)
    path = save_cartridge(tmp_path / "a.safetensors", make(a), a.fingerprint)
    with pytest.raises(GeometryError, match="made for another model"):
        check_fits(load_cartridge(path), b.fingerprint, str(path))


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "not_safetensors"])
def test_damaged_file_is_a_clear_error_naming_it(tmp_path, damage):
    lm = tiny_llama()
    path = save_cartridge(tmp_path / "c.safetensors", make(lm), lm.fingerprint)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 50]
    elif damage == "flip":
        data[-10] ^= 0x40
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(b"PK\x03\x04 this is a zip, not a cartridge" * 4)
    path.write_bytes(bytes(data))
    with pytest.raises(CartridgeFileError) as err:
        load_cartridge(path)
    assert str(path) in str(err.value)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(CartridgeFileError, match="no such cartridge file"):
        load_cartridge(tmp_path / "nope.safetensors")
