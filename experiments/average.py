"""Averaging the cartridge's rows over training, read off one training run per training order.

A 30-minute point's closure moves by about 0.06 with the training order alone (experiments/
LAB.md): the rows end wherever the last few optimizer steps left them. An average of the
rows over the last steps (Polyak, or an exponential moving average) is a readout of the same
trajectory, so every readout here comes from one run per order, and the readouts of one run
are paired with no training-order noise between them. Each order trains today's recipe
(`TrainConfig(p=256)`, its other fields the defaults) on a store's own synthesis; the run
keeps the final rows, the rows after the first epoch, uniform averages over the last
`--tail` shares of the steps (of all of them, and of the first epoch's: the first epoch is
an `--epochs 1` run) and exponential averages with the `--ema` decays. Every readout
is scored on the eval document's questions (gold NLL, closure against the bare and
in-context gold NLLs of the point's record) and paired by question against the final rows,
per order and pooled over the orders.

Run: `python -m experiments.average --store S --record R.jsonl --orders 7 8 9 [--json]`;
`python -m experiments.average pair --record R.jsonl --base SPEC... --other SPEC...` pairs
readouts of different runs (another synthesis, another epoch count) by question.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from cartridges.core.cartridge import Cartridge, init_cartridge
from cartridges.core.models import LoadedModel
from cartridges.core.train import TailAverage, group_backward, lr_at, make_optimizer, mean_loss
from cartridges.evaluation.evaluate import Arm, score_arm
from cartridges.evaluation.qa import read_questions
from experiments.curve import (
    kept_answers,
    paired,
    point_closure,
    pooled,
    question_changes,
    with_cartridge,
)
from experiments.hidden_match import open_point
from schemas import TrainConfig
from stages.train import corpus_of, schedule

FINAL = "final"


class Readouts:
    """Averages of a cartridge's trainable rows over a run, and snapshots, keyed by readout name."""

    def __init__(self, cart: Cartridge, steps: int, tails: list[float], decays: list[float], epochs: int = 2) -> None:
        self.cart, self.steps = cart, steps
        self.epoch = steps // epochs if epochs > 1 else 0  # the first epoch's steps (none of its own in a 1-epoch run)
        self.tails = {f"tail{t:g}": TailAverage(t, steps) for t in tails}
        # the first epoch is the whole of an `--epochs 1` run with the same seed (stages.train.schedule)
        self.first = {f"epoch1_tail{t:g}": TailAverage(t, self.epoch) for t in tails} if self.epoch else {}
        self.decays = {f"ema{d:g}": d for d in decays}
        self.emas = {name: self._now() for name in self.decays}
        self.snapshots: dict[str, list[torch.Tensor]] = {}

    def _now(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.cart.parameters()]

    def after(self, step: int) -> None:
        """Fold in the rows as they stand after 0-based `step`."""
        for tail in self.tails.values():
            tail.update(step, self.cart)
        if step < self.epoch:
            for tail in self.first.values():
                tail.update(step, self.cart)
        now = self._now()
        for name, d in self.decays.items():
            self.emas[name] = [d * e + (1 - d) * x for e, x in zip(self.emas[name], now, strict=True)]
        if step + 1 == self.epoch:
            self.snapshots["epoch1"] = now
        if step + 1 == self.steps:
            self.snapshots[FINAL] = now

    def all(self) -> dict[str, list[torch.Tensor]]:
        means = {name: tail.mean for name, tail in (self.tails | self.first).items()}
        return {FINAL: self.snapshots[FINAL], **self.snapshots, **means, **self.emas}


def train_order(lm: LoadedModel, text: str, train, config: TrainConfig, tails, decays) -> tuple[Cartridge, Readouts]:
    """One training run of `config` (its `seed` is the order), as `stages.train` trains."""
    groups = schedule(train, config)
    cart = init_cartridge(lm, text, config.init, config.p, config.frozen, config.seed, ())
    opt = make_optimizer(cart, config.lr)
    reads = Readouts(cart, len(groups), tails, decays, config.epochs)
    for step, group in enumerate(groups):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, len(groups), config.lr, config.schedule, config.warmup)
        opt.zero_grad(set_to_none=True)
        group_backward(lm.model, [cart], group, packed=config.pack)
        opt.step()
        reads.after(step)
        if step % 50 == 0:
            print(f"order {config.seed}: step {step + 1} of {len(groups)}", flush=True)
    return cart, reads


def readout_golds(spec: str) -> dict[int, float]:
    """Gold NLL by question line of `FILE:ORDER:READOUT` (the last line of a `--json` output
    of this module), or of `FILE` alone (an `experiments.curve` record: its point's cartridge)."""
    path, *rest = spec.split(":")
    last = json.loads(Path(path).read_text().splitlines()[-1])
    if not rest:
        return {line: v["cartridge"] for line, v in (kept_answers(last) or {}).items()}
    order, name = rest
    return {int(line): gold for line, gold in last["gold_nll"][order][name].items()}


def pair_main(argv: list[str]) -> None:
    """`pair`: readouts of different runs (another synthesis, another epoch count) paired by
    question, pair by pair, and pooled over the pairs (the same questions: one draw for all)."""
    ap = argparse.ArgumentParser(prog="python -m experiments.average pair", description=pair_main.__doc__)
    ap.add_argument("--record", required=True, help="a curve record of the document, for the bare and in-context gold NLLs")
    ap.add_argument("--base", nargs="+", required=True, help="FILE:ORDER:READOUT or a curve record FILE, one per pair")
    ap.add_argument("--other", nargs="+", required=True, help="the same, as many as --base")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if len(args.base) != len(args.other):
        raise SystemExit("average pair: --base and --other need as many readouts each")
    kept = kept_answers(json.loads(Path(args.record).read_text().splitlines()[-1])) or {}

    changes = [question_changes(with_cartridge(kept, readout_golds(a)), with_cartridge(kept, readout_golds(b)))
               for a, b in zip(args.base, args.other, strict=True)]
    out = {"pairs": [], "pooled": pooled(changes, groups=[0] * len(changes))}
    for a, b, change in zip(args.base, args.other, changes, strict=True):
        pair = paired(change)
        out["pairs"].append({"base": a, "other": b, **pair})
        lo, hi = pair["closure_change_ci"]
        print(f"{a} -> {b}: {pair['closure_change']:+.4f} ({lo:+.4f} to {hi:+.4f}), lower on {pair['better']} of "
              f"{pair['questions']}", flush=True)
    lo, hi = out["pooled"]["closure_change_ci"]
    print(f"pooled over {len(changes)}: {out['pooled']['closure_change']:+.4f} ({lo:+.4f} to {hi:+.4f})", flush=True)
    if args.json:
        print(json.dumps(out))


def main() -> None:
    if sys.argv[1:2] == ["pair"]:
        return pair_main(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True, help="a point's store (experiments.curve run --store ...)")
    ap.add_argument("--record", required=True, help="that point's record file, for the bare and in-context gold NLLs")
    ap.add_argument("--qa", default="docs/eval/questions.jsonl")
    ap.add_argument("--orders", type=int, nargs="+", default=[7, 8], help="training orders (TrainConfig.seed)")
    ap.add_argument("--tail", type=float, nargs="*", default=[0.1, 0.25, 0.5], help="shares of the last steps averaged")
    ap.add_argument("--ema", type=float, nargs="*", default=[0.9, 0.97], help="decays of exponential averages")
    ap.add_argument("--p", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=2, help="passes over the conversations (today's recipe: 2)")
    ap.add_argument("--conversations", type=int, default=0, help="train on the first N conversations only (0: all)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    store = Path(args.store)
    lm, _, train, heldout, docs = open_point(store)
    train = train[: args.conversations or None]
    text = corpus_of(docs)
    record = json.loads(Path(args.record).read_text().splitlines()[-1])
    questions = [q for q in read_questions(args.qa)[0] if q.doc == docs[0]["name"]]
    kept = kept_answers(record) or {}
    out: dict = {"store": str(store), "train_conversations": len(train), "orders": {}}
    golds: dict[int, dict[str, dict]] = {}
    for order in args.orders:
        cart, reads = train_order(lm, text, train, TrainConfig(p=args.p, seed=order, epochs=args.epochs), args.tail, args.ema)
        golds[order], out["orders"][order] = {}, {}
        for name, leaves in reads.all().items():
            c = cart.with_trainable(leaves)
            rows = c.detached_rows()
            scored, _ = score_arm(lm, Arm("cartridge", key=lambda q: "", rows=lambda q: rows),  # noqa: B023
                                  questions, likelihood_only=True)
            point = golds[order][name] = with_cartridge(kept, {q.line: s.gold_nll for q, s in zip(questions, scored, strict=True)})
            closure = point_closure(point)
            out["orders"][order][name] = {"closure": closure, "heldout": mean_loss(lm.model, [c], heldout),
                                          "accuracy": sum(bool(s.correct) for s in scored) / len(scored)}
            if name != FINAL:
                out["orders"][order][name]["paired"] = paired(question_changes(golds[order][FINAL], point))
            r = out["orders"][order][name]
            change = f", paired {r['paired']['closure_change']:+.4f}" if "paired" in r else ""
            print(f"order {order} {name}: closure {closure:.3f}, held-out {r['heldout']:.4f}, "
                  f"accuracy {r['accuracy']:.1%}{change}", flush=True)
    out["pooled"] = {}
    for name in golds[args.orders[0]]:
        if name == FINAL:
            continue
        pool = pooled([question_changes(golds[o][FINAL], golds[o][name]) for o in args.orders], groups=[0] * len(args.orders))
        out["pooled"][name] = pool | {"closure": sum(out["orders"][o][name]["closure"] for o in args.orders) / len(args.orders)}
        ci = pool["closure_change_ci"]
        print(f"pooled {name}: closure {out['pooled'][name]['closure']:.3f}, change {pool['closure_change']:+.4f} "
              f"({ci[0]:+.4f} to {ci[1]:+.4f})", flush=True)
    finals = [out["orders"][o][FINAL]["closure"] for o in args.orders]
    print(f"final rows: closure {', '.join(f'{c:.3f}' for c in finals)} over orders {args.orders}", flush=True)
    if args.json:  # with each readout's gold NLL by question line, to pair it against other runs
        out["gold_nll"] = {o: {name: {line: v["cartridge"] for line, v in point.items()} for name, point in by.items()}
                           for o, by in golds.items()}
        print(json.dumps(out))


if __name__ == "__main__":
    main()
