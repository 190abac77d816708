"""Capacity ceiling: a cartridge distilled on the eval's own questions.

Self-study asks about what it happens to sample; this asks exactly what the eval
asks. Each question's options (or only the correct one) are supervised as the
assistant's reply, with the teacher's top-k targets taken from the model that has
the whole document in context. If such a cartridge closes the gap to in-context
answering, the p rows have the capacity and any shortfall of a self-study
cartridge is coverage. With `--split`, training uses every other question and
the rest measure transfer to questions it was not trained on.

Run: `python -m experiments.oracle --qa docs/eval/questions.jsonl --doc docs/eval/raft.md [--json]`.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from cartridges.core.cartridge import Cartridge, init_from_corpus
from cartridges.core.models import LoadedModel, backbone, cache_keyword, load_model, project
from cartridges.core.prefix import Rows, prefix_cache
from cartridges.core.targets import truncate_topk
from cartridges.core.train import Example, group_backward, make_optimizer, mean_loss
from cartridges.evaluation.evaluate import Arm, closure, document_context, score_arm, summarize_arm
from cartridges.evaluation.qa import Question, read_questions
from cartridges.evaluation.scoring import native_context, reply_ids, student_prompt

ANSWER_RESERVE = 256  # as the eval stage: positions kept free after the document


@torch.no_grad()
def _teacher(lm: LoadedModel, context_rows: Rows, seq: list[int], start: int, k: int,
             mass: float) -> list[tuple[list[int], list[float]]]:
    """Top-k targets for `seq[start:]`, continuing the document's prefill as the eval's ICL arm
    does (the document is prefilled once, not once per option)."""
    body = backbone(lm.model)
    past = int(context_rows[0][0].shape[1])
    mask = torch.ones(1, past + len(seq), dtype=torch.long, device=lm.device)
    out = body(input_ids=torch.tensor([seq], device=lm.device), attention_mask=mask, use_cache=True,
               **{cache_keyword(body): prefix_cache(context_rows, 1)})
    return truncate_topk(project(lm.model, out.last_hidden_state[0, start - 1: len(seq) - 1]), k, mass)


def oracle_examples(lm: LoadedModel, context: list[int], questions: list[Question], correct_only: bool = False,
                    k: int = 20, mass: float = 0.99) -> list[Example]:
    """Per question and option: the bare question and the option as the reply (the student), with
    targets from the same tokens after the document's system turn (the teacher)."""
    tok, examples = lm.tokenizer, []
    context_rows = native_context(lm, context)
    for q in questions:
        prompt = student_prompt(tok, q.question)
        options = [q.options[q.answer]] if correct_only else list(q.options)
        for option in options:
            reply = reply_ids(tok, prompt, option)
            targets = _teacher(lm, context_rows, prompt + reply, len(prompt), k, mass)
            examples.append(Example(len(examples), prompt + reply, list(range(len(prompt), len(prompt) + len(reply))),
                                    [ids for ids, _ in targets], [lps for _, lps in targets]))
    return examples


def train_oracle(lm: LoadedModel, cart: Cartridge, examples: list[Example], epochs: int = 6, lr: float = 2e-2,
                 batch: int = 8, seed: int = 0, log=print) -> list[float]:
    """Adam over shuffled groups of `batch` examples; the mean loss over all examples after each epoch."""
    opt = make_optimizer(cart, lr)
    rng = random.Random(seed)
    curve = []
    for epoch in range(epochs):
        order = list(examples)
        rng.shuffle(order)
        for i in range(0, len(order), batch):
            opt.zero_grad(set_to_none=True)
            group_backward(lm.model, [cart], order[i: i + batch])
            opt.step()
        curve.append(mean_loss(lm.model, [cart], examples))
        log(f"oracle: epoch {epoch + 1}/{epochs} loss {curve[-1]:.4f}")
    return curve


def evaluate(lm: LoadedModel, context: list[int], questions: list[Question], carts: dict[str, Cartridge]) -> dict:
    """Bare, in-context and each cartridge on `questions`: accuracy and gold NLL with both closures."""
    arms = [Arm("bare", key=lambda q: "", rows=lambda q: []), Arm("icl", key=lambda q: "", context=lambda q: context)]
    arms += [Arm(name, key=lambda q: "", rows=lambda q, c=c: c.rows()) for name, c in carts.items()]
    scored = {arm.name: score_arm(lm, arm, questions, likelihood_only=True)[0] for arm in arms}
    out = {"questions": len(questions),
           "arms": {name: {k: v for k, v in summarize_arm(lm, name, s, float("nan"), []).items()
                           if k in ("accuracy", "accuracy_ci", "gold_nll", "gold_nll_ci")}
                    for name, s in scored.items()}}
    for name in carts:
        out[f"{name}_gap_closure"] = closure(scored, name)
        out[f"{name}_gap_closure_nll"] = closure(scored, name, "gold_nll")
    return out


def run(lm: LoadedModel, qa: str, doc: str, p: int = 256, epochs: int = 6, lr: float = 2e-2, batch: int = 8,
        correct_only: bool = False, split: bool = False, seed: int = 0, log=print) -> dict:
    text = Path(doc).read_text(encoding="utf-8")
    questions = [q for q in read_questions(qa)[0] if q.multiple_choice and q.doc == Path(doc).name]
    if not questions:
        raise SystemExit(f"{qa}: no multiple-choice question names {Path(doc).name}")
    train = questions[::2] if split else questions
    context, cut = document_context(lm, text, ANSWER_RESERVE)
    examples = oracle_examples(lm, context, train, correct_only)
    init = init_from_corpus(lm, text, p=p)
    oracle = init_from_corpus(lm, text, p=p)
    before = mean_loss(lm.model, [oracle], examples)
    curve = train_oracle(lm, oracle, examples, epochs, lr, batch, seed, log)
    result = {"doc": Path(doc).name, "p": p, "epochs": epochs, "lr": lr, "batch": batch,
              "supervised": "correct option" if correct_only else "every option", "examples": len(examples),
              "context_cut": cut, "loss_before": before, "loss_curve": curve,
              "train": evaluate(lm, context, train, {"init": init, "oracle": oracle})}
    log(_line("trained on", result["train"]))
    if split:
        result["heldout"] = evaluate(lm, context, questions[1::2], {"init": init, "oracle": oracle})
        log(_line("held out", result["heldout"]))
    return result


def _line(name: str, part: dict) -> str:
    def c(key: str) -> str:
        v = part[key]
        if v["value"] is None:
            return "null"
        return f"{v['value']:.2f}" + (f" ({v['ci'][0]:.2f} to {v['ci'][1]:.2f})" if v.get("ci") else "")
    arms = "  ".join(f"{a} {r['accuracy']:.1%}/{r['gold_nll']:.3f}" for a, r in part["arms"].items())
    return (f"{name} ({part['questions']} questions), accuracy/gold NLL: {arms}\n"
            f"  oracle closure: accuracy {c('oracle_gap_closure')}, gold NLL {c('oracle_gap_closure_nll')}; "
            f"init closure: accuracy {c('init_gap_closure')}, gold NLL {c('init_gap_closure_nll')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qa", required=True, help="question file (.jsonl) whose questions name --doc")
    parser.add_argument("--doc", required=True, help="the document the questions are about")
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--p", type=int, default=256, help="cartridge rows")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--lr", type=float, default=2e-2)
    parser.add_argument("--batch", type=int, default=8, help="examples per optimizer step")
    parser.add_argument("--correct-only", action="store_true", help="supervise only the correct option")
    parser.add_argument("--split", action="store_true", help="train on every other question, also score the rest")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    lm = load_model(args.model, args.device)
    result = run(lm, args.qa, args.doc, args.p, args.epochs, args.lr, args.batch, args.correct_only, args.split,
                 log=lambda line: print(line, flush=True))
    print(f"oracle cartridge for {result['doc']}: p={result['p']}, {result['examples']} examples, "
          f"loss {result['loss_before']:.4f} -> {result['loss_curve'][-1]:.4f}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
