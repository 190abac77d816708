"""Cartridge files: safetensors (never pickle), one K/V pair per layer plus metadata.

Geometry is recovered from the tensors alone. A sha256 over the tensor bytes is kept
in the metadata because safetensors has no checksum of its own, and another over the
metadata itself (`header_checksum`), so bit flips anywhere in the file are caught.
Writes are atomic (temp file, fsync, rename).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from cartridges.core.cartridge import Cartridge, _brief
from cartridges.core.errors import CartridgeFileError, GeometryError
from cartridges.core.speed import dtype_name
from storage.atomic import atomic_write_bytes

FORMAT = "cartridges"
FORMAT_VERSION = 1
OPTIMIZER_FORMAT = "cartridges-optimizer"


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(name.encode())
        digest.update(str(t.dtype).encode())
        digest.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


_OLD_FIELDS = {"format", "format_version", "model_fingerprint", "p", "frozen", "dtype", "n_layers", "meta",
               "checksum", "step", "adam_step", "n_params"}


def _header_checksum(header: dict) -> str:
    body = {k: v for k, v in header.items() if k != "header_checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _sealed(header: dict) -> dict:
    return {**header, "header_checksum": _header_checksum(header)}


LOADED_FIELDS = ("draft_reference", "path", "model_fingerprint")


def cartridge_bytes(cart: Cartridge, fingerprint: dict, **meta) -> bytes:
    """Serialize a cartridge; `meta` adds fields such as corpus_sha256, steps, draft_reference."""
    tensors: dict[str, torch.Tensor] = {}
    for i, (k, v) in enumerate(cart.detached_rows()):
        tensors[f"layers.{i}.keys"] = k.cpu().contiguous()
        tensors[f"layers.{i}.values"] = v.cpu().contiguous()
    draft = meta.pop("draft_reference", None)
    if draft is None:
        draft = cart.meta.get("draft_reference")
    if draft is not None:
        tensors["draft_reference"] = torch.as_tensor(draft, dtype=torch.int64).cpu().contiguous()
    # what loading added (where the file was read from, the header's own fingerprint) is not the
    # cartridge's: a cartridge trained on from a checkpoint is the file an uninterrupted run writes
    fields = {k: v for k, v in cart.meta.items() if k not in LOADED_FIELDS}
    fields.update(meta)
    header = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "model_fingerprint": json.dumps(fingerprint, sort_keys=True),
        "p": str(cart.p),
        "frozen": str(cart.frozen),
        "dtype": dtype_name(cart.dtype),
        "n_layers": str(cart.n_layers),
        "meta": json.dumps(fields, sort_keys=True, default=str),
        "checksum": _checksum(tensors),
    }
    return st_save(tensors, metadata=_sealed(header))


def save_cartridge(path: str | Path, cart: Cartridge, fingerprint: dict, **meta) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, cartridge_bytes(cart, fingerprint, **meta))
    return path


def _header(path: Path, data: bytes, fmt: str = FORMAT, kind: str = "cartridge") -> dict:
    if len(data) < 8:
        raise CartridgeFileError(f"{path}: truncated ({len(data)} bytes), not a {kind} file")
    (size,) = struct.unpack("<Q", data[:8])
    if size > len(data) - 8:
        raise CartridgeFileError(f"{path}: truncated (header wants {size} bytes, file has {len(data) - 8})")
    try:
        header = json.loads(data[8 : 8 + size])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CartridgeFileError(f"{path}: corrupted header, not a {kind} file ({exc})") from exc
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise CartridgeFileError(f"{path}: corrupted header, not a {kind} file")
    if "header_checksum" in meta:
        if meta["header_checksum"] != _header_checksum(meta):
            raise CartridgeFileError(f"{path}: header checksum mismatch, the file is corrupted")
    elif not set(meta) <= _OLD_FIELDS:  # files from before header checksums hold only these
        raise CartridgeFileError(f"{path}: corrupted header (unknown field(s) "
                                 f"{', '.join(sorted(set(meta) - _OLD_FIELDS))})")
    if meta.get("format") != fmt:
        raise CartridgeFileError(f"{path}: not a {kind} file (safetensors without {kind} metadata)")
    if int(meta.get("format_version", 0)) > FORMAT_VERSION:
        raise CartridgeFileError(
            f"{path}: format version {meta['format_version']} is newer than this build reads ({FORMAT_VERSION})"
        )
    return meta


def _read(path: Path, fmt: str, kind: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """Header metadata and tensors of an intact file of format `fmt` (checksum verified)."""
    if not path.is_file():
        raise CartridgeFileError(f"{path}: no such {kind} file")
    data = path.read_bytes()
    header = _header(path, data, fmt, kind)
    try:
        tensors = st_load(data)
    except Exception as exc:  # safetensors raises its own error type for bad payloads
        raise CartridgeFileError(f"{path}: corrupted tensor data ({exc})") from exc
    if header.get("checksum") != _checksum(tensors):
        raise CartridgeFileError(f"{path}: checksum mismatch, the file is corrupted")
    return header, tensors


def load_cartridge(path: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Cartridge:
    """Read a cartridge file; geometry comes from the tensors, facts from the metadata."""
    path = Path(path)
    header, tensors = _read(path, FORMAT, "cartridge")
    n = int(header["n_layers"])
    try:
        keys = [tensors[f"layers.{i}.keys"] for i in range(n)]
        values = [tensors[f"layers.{i}.values"] for i in range(n)]
    except KeyError as exc:
        raise CartridgeFileError(f"{path}: missing tensor {exc}") from exc
    meta = json.loads(header.get("meta", "{}"))
    meta["model_fingerprint"] = json.loads(header["model_fingerprint"])
    meta["path"] = str(path)
    if "draft_reference" in tensors:
        meta["draft_reference"] = tensors["draft_reference"]
    cart = Cartridge(keys, values, int(header["frozen"]), meta)
    if int(header["p"]) != cart.p:
        raise CartridgeFileError(f"{path}: metadata says p={header['p']}, tensors hold {cart.p} rows")
    return cart.to(device=device, dtype=dtype) if (device is not None or dtype is not None) else cart


def check_fits(cart: Cartridge, fingerprint: dict, source: str = "cartridge") -> None:
    """A cartridge for another model is an error naming both models and geometries."""
    made_for = cart.meta.get("model_fingerprint", {})
    if cart.geometry != fingerprint["layers"]:
        raise GeometryError(
            f"{source}: geometry {_brief(cart.geometry)} ({made_for.get('architecture', '?')}) "
            f"does not fit the model's {_brief(fingerprint['layers'])} ({fingerprint['architecture']})"
        )
    for key in ("config_hash", "tokenizer_hash", "weights_hash"):
        if made_for.get(key) and made_for.get(key) != fingerprint.get(key):
            raise GeometryError(
                f"{source}: made for another model ({key} {made_for[key]} != {fingerprint[key]}; "
                f"{made_for.get('architecture', '?')} vs {fingerprint['architecture']}, same geometry)"
            )


def save_optimizer(path: str | Path, opt: torch.optim.Optimizer, step: int, **meta) -> Path:
    """Adam moments of every trainable leaf, in leaf order, with the step counter."""
    tensors: dict[str, torch.Tensor] = {}
    params = [p for group in opt.param_groups for p in group["params"]]
    adam_step = 0
    for i, p in enumerate(params):
        state = opt.state.get(p, {})
        if "exp_avg" in state:
            tensors[f"{i}.exp_avg"] = state["exp_avg"].detach().cpu().contiguous()
            tensors[f"{i}.exp_avg_sq"] = state["exp_avg_sq"].detach().cpu().contiguous()
            adam_step = int(state["step"])
    header = {
        "format": OPTIMIZER_FORMAT, "format_version": "1", "step": str(step),
        "adam_step": str(adam_step), "n_params": str(len(params)),
        "meta": json.dumps(meta, sort_keys=True, default=str), "checksum": _checksum(tensors),
    }
    path = Path(path)
    atomic_write_bytes(path, st_save(tensors, metadata=_sealed(header)))
    return path


def load_optimizer(path: str | Path, opt: torch.optim.Optimizer) -> dict:
    """Restore moments saved by `save_optimizer`; returns its metadata (step, meta)."""
    path = Path(path)
    header, tensors = _read(path, OPTIMIZER_FORMAT, "optimizer")
    params = [p for group in opt.param_groups for p in group["params"]]
    if int(header["n_params"]) != len(params):
        raise GeometryError(f"{path}: holds moments for {header['n_params']} leaves, the cartridge has {len(params)}")
    for i, p in enumerate(params):
        if f"{i}.exp_avg" in tensors:
            opt.state[p] = {
                "step": torch.tensor(float(header["adam_step"])),
                "exp_avg": tensors[f"{i}.exp_avg"].to(p),
                "exp_avg_sq": tensors[f"{i}.exp_avg_sq"].to(p),
            }
    return {"step": int(header["step"]), "meta": json.loads(header.get("meta", "{}"))}
