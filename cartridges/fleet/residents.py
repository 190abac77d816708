"""Resident cartridges: rows plus their own Adam, moved between memory and the fleet directory.

A resident is one document's cartridge, its optimizer and its step counter. Evicting
writes rows and moments to files named by the step counter; reloading reads them back
into fresh leaves and a fresh Adam, which continues bit-identically to never having
left (the warm-up lr is keyed to the same counter).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from cartridges.core.cartridge import Cartridge, init_from_corpus
from cartridges.core.errors import CartridgeError, FleetError
from cartridges.core.files import (
    check_fits,
    load_cartridge,
    load_optimizer,
    save_cartridge,
    save_optimizer,
)
from cartridges.core.models import LoadedModel
from cartridges.core.train import Example, group_backward, make_optimizer
from cartridges.fleet.budget import warmup_lr
from cartridges.fleet.manifest import DocEntry
from storage.faults import fault_point


@dataclass
class Resident:
    doc_id: int
    cart: Cartridge
    opt: torch.optim.Adam
    steps: int

    def step(self, lr: float, warmup: int) -> float:
        """One Adam step at the warm-up lr of this cartridge's own counter; returns that lr."""
        rate = warmup_lr(lr, self.steps, warmup)
        for group in self.opt.param_groups:
            group["lr"] = rate
        self.opt.step()
        self.steps += 1
        return rate


def new_resident(lm: LoadedModel, entry: DocEntry, text: str, p: int, frozen: int, lr: float) -> Resident:
    """A corpus-init cartridge for one document (its own text's first p tokens), fresh Adam."""
    cart = init_from_corpus(lm, text, p, frozen)
    return Resident(entry.doc_id, cart, make_optimizer(cart, lr), 0)


def save_resident(directory: Path, lm: LoadedModel, entry: DocEntry, res: Resident) -> DocEntry:
    """Write rows and moments under names keyed by the step counter; returns the updated entry."""
    entry.steps = res.steps
    stem = entry.file_stem()
    cart_name, opt_name = f"{stem}.safetensors", f"{stem}.adam.safetensors"
    save_cartridge(directory / cart_name, res.cart, lm.fingerprint, steps=res.steps,
                   corpus_sha256=entry.sha256, document=entry.name)
    fault_point("fleet.save.optimizer")  # rows written, moments not yet
    save_optimizer(directory / opt_name, res.opt, res.steps, corpus_sha256=entry.sha256, document=entry.name)
    entry.cartridge, entry.optimizer = cart_name, opt_name
    return entry


def load_resident(directory: Path, lm: LoadedModel, entry: DocEntry, lr: float) -> Resident:
    """Read one document's rows and moments; a file for another document or step is an error."""
    cart_path, opt_path = directory / entry.cartridge, directory / entry.optimizer
    try:
        cart = load_cartridge(cart_path, device=lm.device)
    except CartridgeError as exc:
        raise FleetError(f"fleet document {entry.name!r}: {exc}") from exc
    check_fits(cart, lm.fingerprint, str(cart_path))
    check_file_matches(cart_path, cart.meta, entry)
    cart.meta = {k: v for k, v in cart.meta.items() if k not in ("path", "model_fingerprint")}
    opt = make_optimizer(cart, lr)
    try:
        info = load_optimizer(opt_path, opt)
    except CartridgeError as exc:
        raise FleetError(f"fleet document {entry.name!r}: {exc}") from exc
    check_file_matches(opt_path, {**info["meta"], "steps": info["step"]}, entry)
    return Resident(entry.doc_id, cart, opt, entry.steps)


def check_file_matches(path: Path, meta: dict, entry: DocEntry) -> None:
    if meta.get("corpus_sha256") != entry.sha256:
        raise FleetError(f"{path}: holds document {meta.get('document')!r} (sha256 {str(meta.get('corpus_sha256'))[:12]}), "
                         f"the manifest expects {entry.name!r} (sha256 {entry.sha256[:12]})")
    if int(meta.get("steps", -1)) != entry.steps:
        raise FleetError(f"{path}: holds step {meta.get('steps')}, the manifest expects step {entry.steps}")


def load_rows(directory: Path, lm: LoadedModel, entry: DocEntry) -> Cartridge:
    """Just the rows of one document, checked against the manifest, in the model's dtype."""
    path = directory / entry.cartridge
    try:
        cart = load_cartridge(path, device=lm.device, dtype=lm.dtype)
    except CartridgeError as exc:
        raise FleetError(f"fleet document {entry.name!r}: {exc}") from exc
    check_fits(cart, lm.fingerprint, str(path))
    check_file_matches(path, cart.meta, entry)
    return cart


def train_group(
    model: torch.nn.Module, parts: list[Resident], examples: list[Example], lr: float, warmup: int,
    trainable: set[int] | None = None, pack: bool = True,
) -> tuple[float, dict[int, float]]:
    """One optimizer group behind the composed parts; every trainable part takes its own step.

    Returns the group loss and the lr each stepped part used (by doc id).
    """
    for res in parts:
        res.opt.zero_grad(set_to_none=True)
    loss = group_backward(model, [r.cart for r in parts], examples, packed=pack)
    rates = {}
    if sum(ex.n for ex in examples) == 0:
        return loss, rates
    for res in parts:
        if trainable is None or res.doc_id in trainable:
            rates[res.doc_id] = res.step(lr, warmup)
        res.opt.zero_grad(set_to_none=True)
    return loss, rates
