"""What a trained cartridge's held-out drop can be read against.

By default (``heldout_region="sample"``) held-out chunks are separately seeded
samples over the same documents the training chunks tile, so the held-out loss
measures how well the cartridge stored the corpus. With ``heldout_region="tail"``
they come from each document's reserved tail, text no training chunk covers, and a
cartridge can lower the held-out loss only by what carries over from the rest of
the corpus. This scores a store's held-out conversations behind three reference
prefixes and beside the trained cartridge:

- ``init``: the run's untrained cartridge, built by its own init (the run's "before");
- ``training_region``: the text training chunks may cover, in context, i.e. a
  cartridge that stored the training text perfectly (every document up to its
  reserved tail with "tail"; the whole corpus with "sample");
- ``whole_corpus``: the whole corpus in context, held-out text included (ICL).

Run: `python -m experiments.heldout_reference --store DIR [--json]` after a training run.
"""

from __future__ import annotations

import argparse
import json

from cartridges.core.cartridge import Cartridge, init_cartridge
from cartridges.core.chat import system_ids
from cartridges.core.corpus import document_text
from cartridges.core.models import LoadedModel, load_model
from cartridges.core.train import mean_loss
from cartridges.evaluation.scoring import native_context
from schemas import ChunkConfig, TrainConfig
from stages.chunks import heldout_reserve
from stages.train import corpus_of, load_examples, summary_of
from storage import Store, StoreError


def training_region(docs: list[dict], config: ChunkConfig, tokenizer) -> str:
    """The corpus as training chunks may cover it: each document cut before its reserved tail, if any."""
    multi = len(docs) > 1
    parts = []
    for d in docs:
        ids = tokenizer(d["text"], add_special_tokens=False)["input_ids"]
        keep = len(ids) - heldout_reserve(len(ids), config)
        parts.append(document_text(d["name"], tokenizer.decode(ids[:keep]), multi))
    return "\n".join(parts)


def in_context(lm: LoadedModel, text: str) -> Cartridge:
    """The exact KV of ``text`` as a system turn, prefilled as the eval's ICL arm does."""
    return Cartridge.from_rows(native_context(lm, system_ids(lm.tokenizer, text)), frozen=1)


def lineage(store: Store, train_id: str | None = None) -> dict:
    """The train artifact (default: the latest complete one) and the artifacts it was built from."""
    train = store.catalog.get(train_id) if train_id else store.latest("train")
    if train is None or train.stage != "train" or not train.complete:
        what = f"complete train artifact {train_id!r}" if train_id else "complete train artifact"
        raise StoreError(f"{store.root}: no {what}; train a cartridge first (see `cartridges runs`)")
    documents, conversations, targets = (store.catalog.get(i) for i in train.inputs)
    chunks = store.catalog.get(conversations.inputs[1])
    return {"ingest": documents, "chunks": chunks, "synthesize": conversations, "teacher": targets, "train": train}


def _recorded(cls, config: dict, before: dict):
    """A stage's recorded config as `cls`: fields added since take their `before` value, and
    keys the stage's fingerprint holds beyond the config's fields are dropped."""
    fields = set(cls.__dataclass_fields__)
    return cls.from_dict({**before, **{k: v for k, v in config.items() if k in fields}})


def references(store: Store, lm: LoadedModel, train_id: str | None = None) -> dict:
    """Held-out losses behind each reference prefix and beside a trained cartridge."""
    arts = lineage(store, train_id)
    docs = store.table(arts["ingest"]).to_pylist()
    _, heldout = load_examples(store.table(arts["synthesize"]), store.table(arts["teacher"]))
    if not heldout:
        raise StoreError(f"{store.root}: the run has no held-out conversations (heldout=0?)")
    # Chunk plans recorded before heldout_region existed all reserved tails.
    chunk_cfg = _recorded(ChunkConfig, arts["chunks"].config, {"heldout_region": "tail"})
    trained = summary_of(store, arts["train"])
    text = corpus_of(docs)
    # Runs recorded before "init" existed used the corpus init.
    train_cfg = _recorded(TrainConfig, arts["train"].config, {"init": "corpus"})
    start = init_cartridge(lm, text, train_cfg.init, train_cfg.p, train_cfg.frozen, train_cfg.seed)
    losses = {
        "init": mean_loss(lm.model, [start], heldout),
        "trained": trained["heldout_loss_after"],
        "training_region": mean_loss(lm.model, [in_context(lm, training_region(docs, chunk_cfg, lm.tokenizer))],
                                     heldout),
        "whole_corpus": mean_loss(lm.model, [in_context(lm, text)], heldout),
    }
    base = losses["init"]
    return {"heldout_conversations": len(heldout), "p": int(trained["p"]), "losses": losses,
            "change": {k: v / base - 1 for k, v in losses.items()},
            "trained_init_loss": trained["heldout_loss_before"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True, help="artifact store of a finished training run")
    ap.add_argument("--train", default=None, help="train artifact id (default: the latest complete one)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    lm = load_model(args.model, None)
    out = references(Store(args.store, read_only=True), lm, args.train)
    print(f"held-out conversations: {out['heldout_conversations']}, p={out['p']}")
    for name, loss in out["losses"].items():
        print(f"  {name:16s} {loss:.4f}  {out['change'][name]:+.1%}")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
