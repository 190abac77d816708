"""The fleet's training loop state: residents in memory, rounds, rotations and checkpoints.

A checkpoint writes every resident whose step counter moved since its files (names
keyed by the counter), then the manifest; so the manifest always describes a
consistent fleet, and a crash loses at most the rounds since the last checkpoint,
which a resume replays identically (plans are keyed by (seed, round)). Checkpoints
happen at every rotation and at the end of a run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from cartridges.core.models import LoadedModel
from cartridges.core.train import Example, mean_loss
from cartridges.fleet.budget import is_rotation_round, rotation
from cartridges.fleet.manifest import Manifest, prune, write_manifest
from cartridges.fleet.plan import RoundPlan, plan_round
from cartridges.fleet.residents import Resident, load_resident, save_resident, train_group
from schemas import FleetConfig
from storage.faults import fault_point


class FleetTrainer:
    """Holds the resident cartridges of one run; `trainable` are the doc ids this run may train."""

    def __init__(self, directory: Path, lm: LoadedModel, manifest: Manifest, config: FleetConfig,
                 trainable: list[int], residents: list[int]) -> None:
        self.directory, self.lm, self.manifest, self.config = Path(directory), lm, manifest, config
        self.trainable = sorted(trainable)
        self.residents = sorted(residents)
        self.memory: dict[int, Resident] = {}
        # Called with each round's row before any checkpoint can count the round as done.
        self.journal: Callable[[dict], None] | None = None
        for doc_id in self.residents:
            self.memory[doc_id] = load_resident(self.directory, lm, self.entries[doc_id], config.lr)

    @property
    def entries(self):
        return self.manifest.by_id()

    def steps(self) -> dict[int, int]:
        """Step counters of the trainable documents (in memory when resident)."""
        out = {}
        for doc_id in self.trainable:
            res = self.memory.get(doc_id)
            out[doc_id] = res.steps if res is not None else self.entries[doc_id].steps
        return out

    def plan(self, round_index: int) -> RoundPlan:
        tokens = {d: self.entries[d].tokens for d in self.residents}
        return plan_round(round_index, self.residents, tokens, self.config, self.steps())

    def train(self, plan: RoundPlan, examples: list[Example]) -> dict:
        """One round: the group behind the composed parts, every trainable part steps."""
        start = time.perf_counter()
        parts = [self.memory[d] for d in plan.parts]
        stepping = set(plan.parts) if self.config.distractors == "train" else {plan.target}
        loss, rates = train_group(self.lm.model, parts, examples, self.config.lr, self.config.warmup,
                                  trainable=stepping, pack=self.config.pack)
        names = self.entries
        row = {
            "step": plan.round, "docs": [names[d].name for d in plan.parts], "visibility": plan.visibility,
            "loss": loss, "lr": rates.get(plan.target, 0.0), "tokens": sum(ex.n for ex in examples),
            "seconds": time.perf_counter() - start, "heldout_loss": None,
        }
        if self.journal is not None:
            self.journal(row)
        self.manifest.rounds = plan.round + 1
        fault_point(f"fleet.round.{plan.round}")
        if is_rotation_round(plan.round, self.config.rotate_every):
            self.rotate()
        return row

    def rotate(self) -> tuple[list[int], list[int]]:
        """Evict the most-trained residents to disk and load the least-trained absentees."""
        evicted, entering = rotation(self.residents, self.steps(), self.config.evict_frac)
        self.residents = sorted((set(self.residents) - set(evicted)) | set(entering))
        self.checkpoint()
        for doc_id in evicted:
            del self.memory[doc_id]
        for doc_id in entering:
            self.memory[doc_id] = load_resident(self.directory, self.lm, self.entries[doc_id], self.config.lr)
        return evicted, entering

    def checkpoint(self) -> None:
        """Write residents whose counters moved, then the manifest, then drop superseded files."""
        entries = self.entries
        for doc_id, res in self.memory.items():
            entry = entries[doc_id]
            if res.steps != entry.steps or not (self.directory / entry.cartridge).is_file():
                save_resident(self.directory, self.lm, entry, res)
                fault_point(f"fleet.checkpoint.resident.{doc_id}")
        self.manifest.residents = list(self.residents)
        write_manifest(self.directory, self.manifest)
        fault_point("fleet.checkpoint.manifest")  # manifest written, superseded files not yet pruned
        prune(self.directory, self.manifest)

    def heldout_loss(self, doc_id: int, examples: list[Example], distractors: list[int] = (),
                     position: int | None = None) -> float | None:
        """Held-out loss of one document's cartridge, alone or among distractors (at `position`)."""
        parts = [self._cart(d) for d in distractors]
        parts.insert(len(parts) if position is None else position, self._cart(doc_id))
        return mean_loss(self.lm.model, parts, examples)

    def _cart(self, doc_id: int):
        res = self.memory.get(doc_id)
        if res is not None:
            return res.cart
        return load_resident(self.directory, self.lm, self.entries[doc_id], self.config.lr).cart
