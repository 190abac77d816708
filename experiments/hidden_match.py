"""Per-layer hidden-state matching beside the distillation loss, on a store's own synthesis.

The top-k loss supervises only the answer tokens' output distributions. The teacher (the
chunk in context) also gives every layer's residual stream at every token of the
conversation, a denser signal that might teach the rows more per conversation. Each arm
trains a cartridge from the same init on the same conversations in the same order; arm
`lam` adds `lam` times the mean over layers of the relative squared error
||h_student - h_teacher||^2 / ||h_teacher||^2 over the conversation's tokens. The arms are
then scored on the eval document's questions (gold NLL, closure against the bare and
in-context gold NLLs of a record from `experiments.curve`), paired by question.

Run: `python -m experiments.hidden_match --store S --record R.jsonl --lam 0 1 20 [--json]`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

from cartridges.core.cartridge import compose_rows, init_cartridge
from cartridges.core.loss import sparse_distill
from cartridges.core.models import LoadedModel, backbone, cache_keyword, load_model
from cartridges.core.prefix import PrefixCache, attention_masks, layout
from cartridges.core.speed import choose_threads
from cartridges.core.train import Example, make_optimizer, mean_loss, pad_topk
from cartridges.evaluation.evaluate import Arm, score_arm
from cartridges.evaluation.qa import read_questions
from experiments.curve import kept_answers, paired, point_closure, question_changes, with_cartridge
from stages.train import load_examples


def largest(store: Path, stage: str) -> Path:
    """The stage's artifact with the most rows (the run's, not its pilot's)."""
    return max(store.glob(f"{stage}/*/"), key=lambda a: sum(pq.read_metadata(f).num_rows for f in a.glob("*.parquet")))


def open_point(store: Path):
    """The default model in float32, on the cores free now (or CARTRIDGES_THREADS, as the CLI's
    commands run), and the point's conversations, training and held-out examples and documents."""
    torch.manual_seed(0)
    choose_threads()
    lm = load_model(None, dtype="float32")
    convs = pq.read_table(largest(store, "synthesize"))
    train, heldout = load_examples(convs, pq.read_table(largest(store, "teacher")))
    return lm, convs, train, heldout, pq.read_table(next(store.glob("ingest/*/"))).to_pylist()


def hidden_states(lm: LoadedModel, ids: list[int], rows=None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Final hidden states `[L, D]` and every layer's `[L, D]` of `ids` behind `rows` (none: alone)."""
    model = backbone(lm.model)
    x = torch.tensor([ids], device=lm.device)
    kwargs = {"input_ids": x, "use_cache": False, "output_hidden_states": True}
    if rows is not None:
        positions, allowed = layout(rows[0][0].shape[-2], x.shape, None, None, x.device)
        kwargs.update(attention_mask=attention_masks(model, allowed, rows[0][0].dtype), position_ids=positions,
                      use_cache=True, **{cache_keyword(model): PrefixCache(rows, 1)})
    out = model(**kwargs)
    return out.last_hidden_state[0], tuple(h[0] for h in out.hidden_states)


def relative_error(student: tuple[torch.Tensor, ...], teacher: tuple[torch.Tensor, ...], head: int) -> torch.Tensor:
    """Mean over the decoder layers' outputs (the embeddings and the final-norm output, which the
    top-k loss reads, left out) of ||h_student - h_teacher||^2 / ||h_teacher||^2, the teacher's
    rows from `head` on (its chunk's system turn cut away) aligned with the student's."""
    layers = range(1, len(student) - 1)
    return sum(((student[i] - teacher[i][head:]) ** 2).sum() / (teacher[i][head:] ** 2).sum()
               for i in layers) / len(layers)


def train_arm(lm: LoadedModel, text: str, examples: list[Example], teacher: dict[int, tuple[list[int], int]],
              lam: float, lr: float, accum: int, seed: int) -> tuple[object, float]:
    cart = init_cartridge(lm, text, "auto", 256, None, seed, ())
    opt = make_optimizer(cart, lr)
    start = time.perf_counter()
    for g in range(0, len(examples), accum):
        group = examples[g : g + accum]
        total = sum(ex.n for ex in group)
        opt.zero_grad(set_to_none=True)
        for ex in group:
            last, student = hidden_states(lm, ex.ids, compose_rows([cart]))
            ids, lps = pad_topk(ex.topk_ids, ex.topk_logprobs, lm.device)
            loss = sparse_distill(last[torch.tensor(ex.positions) - 1], lm.model, ids, lps, reduction="sum") / total
            if lam:
                ids_t, head = teacher[ex.conv_id]
                with torch.no_grad():
                    _, full = hidden_states(lm, ids_t)
                loss = loss + lam * relative_error(student, full, head) * ex.n / total
            loss.backward()
        opt.step()
    return cart, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True, help="a point's store (experiments.curve run --store ...)")
    ap.add_argument("--record", required=True, help="that point's record file, for the bare and in-context gold NLLs")
    ap.add_argument("--qa", default="docs/eval/questions.jsonl")
    ap.add_argument("--conversations", type=int, default=400, help="training conversations (one epoch)")
    ap.add_argument("--lam", type=float, nargs="+", default=[0.0, 20.0], help="weights of the hidden loss; 0 first")
    ap.add_argument("--lr", type=float, default=2e-2)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    store = Path(args.store)
    lm, convs, train, heldout, docs = open_point(store)
    teacher = {c["conv_id"]: (c["teacher_ids"], len(c["teacher_ids"]) - len(c["student_ids"])) for c in convs.to_pylist()}
    doc = docs[0]
    record = json.loads(Path(args.record).read_text().splitlines()[-1])
    questions = [q for q in read_questions(args.qa)[0] if q.doc == doc["name"]]
    order = list(train)
    random.Random(f"{args.seed}:0").shuffle(order)
    order = order[: args.conversations]
    arms = {}
    for lam in args.lam:
        cart, seconds = train_arm(lm, doc["text"], order, teacher, lam, args.lr, 4, args.seed)
        rows = [(k.detach(), v.detach()) for k, v in compose_rows([cart])]
        scored, _ = score_arm(lm, Arm("cartridge", key=lambda q: "", rows=lambda q: rows),  # noqa: B023
                              questions, likelihood_only=True)
        arms[lam] = {"train_s": seconds, "heldout": mean_loss(lm.model, [cart], heldout),
                     "accuracy": sum(bool(s.correct) for s in scored) / len(scored),
                     "gold": {q.line: s.gold_nll for q, s in zip(questions, scored, strict=True)}}
        print(f"lam {lam}: train {seconds:.0f} s, held-out {arms[lam]['heldout']:.4f}, "
              f"accuracy {arms[lam]['accuracy']:.1%}", flush=True)
    kept = kept_answers(record) or {}
    base = with_cartridge(kept, arms[args.lam[0]]["gold"])
    out = {"store": str(store), "conversations": len(order), "arms": {}}
    for lam, arm in arms.items():
        mine = with_cartridge(kept, arm["gold"])
        closure = point_closure(mine)
        pair = paired(question_changes(base, mine)) if lam != args.lam[0] else {}
        out["arms"][str(lam)] = {k: v for k, v in arm.items() if k != "gold"} | {"closure": closure, "paired": pair}
        change = (f", paired {pair['closure_change']:+.4f} ({pair['closure_change_ci'][0]:+.4f} to "
                  f"{pair['closure_change_ci'][1]:+.4f}), lower on {pair['better']} of {pair['questions']}" if pair else "")
        print(f"lam {lam}: closure {closure:.3f}{change}", flush=True)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
