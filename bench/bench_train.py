"""Teacher-pass and training throughput on the default model, measured side by side.

- teacher: supervised tokens/s of the batched, supervised-rows-only teacher pass
  against a per-conversation pass that builds full `[seq, vocab]` logits.
- train: supervised tokens/s of the packed group forward/backward against the flat
  per-conversation path, same groups, same cartridge.

Sequences are random tokens of realistic shape (teacher: chunk + question + answer;
student: question + answer); throughput does not depend on the token values.
Run: `python -m bench.bench_train [--conversations 16] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from cartridges.core.cartridge import Cartridge
from cartridges.core.models import load_model
from cartridges.core.prefix import capture_rows
from cartridges.core.targets import teacher_targets, truncate_topk
from cartridges.core.train import Example, group_backward


def shapes(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """(sequence length, supervised tokens) per conversation, like the default budgets."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        context = int(torch.randint(256, 512, (1,), generator=gen))
        answer = int(torch.randint(40, 160, (1,), generator=gen))
        out.append((context + 40 + answer, answer))
    return out


def bench_teacher(lm, n: int, batch: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    sizes = shapes(n)
    seqs = [torch.randint(0, 40000, (length,), generator=gen).tolist() for length, _ in sizes]
    starts = [length - answer for length, answer in sizes]
    supervised = sum(answer for _, answer in sizes)

    # The two arms alternate per group, so machine drift hits both alike.
    ours = full = 0.0
    for i in range(0, n, batch):
        t0 = time.perf_counter()
        teacher_targets(lm.model, seqs[i : i + batch], starts[i : i + batch])
        ours += time.perf_counter() - t0
        t0 = time.perf_counter()
        with torch.no_grad():
            for seq, start in zip(seqs[i : i + batch], starts[i : i + batch], strict=True):
                logits = lm.model(input_ids=torch.tensor([seq])).logits[0]  # [seq, vocab]
                truncate_topk(logits[start - 1 : len(seq) - 1], 20, 0.99)
        full += time.perf_counter() - t0
    return {
        "teacher_tokens_per_s": supervised / ours,
        "teacher_full_logits_tokens_per_s": supervised / full,
        "teacher_s_per_conversation": ours / n,
        "teacher_full_logits_s_per_conversation": full / n,
        "teacher_speedup": full / ours,
    }


def bench_train(lm, n: int, accum: int, p: int) -> dict:
    gen = torch.Generator().manual_seed(2)
    vocab = lm.model.config.vocab_size
    examples = []
    for c, (_, answer) in enumerate(shapes(n, seed=3)):
        length = 40 + answer  # student: question and answer, the chunk's system turn is gone
        ids = torch.randint(0, 40000, (length,), generator=gen).tolist()
        positions = list(range(length - answer, length))
        topk = [torch.randint(0, vocab, (20,), generator=gen).tolist() for _ in positions]
        lps = [torch.log_softmax(torch.randn(20, generator=gen), 0).sort(descending=True).values.tolist() for _ in positions]
        examples.append(Example(c, ids, positions, topk, lps))
    base = Cartridge.from_rows(capture_rows(lm.model, torch.randint(0, 40000, (p,), generator=gen)))
    supervised = sum(ex.n for ex in examples)
    carts = {name: Cartridge.from_rows(base.detached_rows()) for name in ("packed", "flat")}
    seconds = {"packed": 0.0, "flat": 0.0}
    for i in range(0, n, accum):  # alternate the arms group by group
        for name in ("packed", "flat"):
            t0 = time.perf_counter()
            group_backward(lm.model, [carts[name]], examples[i : i + accum], packed=name == "packed")
            seconds[name] += time.perf_counter() - t0
    result = {f"train_{name}_tokens_per_s": supervised / seconds[name] for name in seconds}
    result["train_packed_over_flat"] = result["train_packed_tokens_per_s"] / result["train_flat_tokens_per_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--p", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the cores this process may use)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="weights and activations (the pipeline's default is bfloat16)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(None, "cpu", args.dtype)
    result = {"conversations": args.conversations, "threads": torch.get_num_threads(), **lm.dtype_record()}
    result.update(bench_teacher(lm, args.conversations, args.batch))
    result.update(bench_train(lm, args.conversations, args.accum, args.p))
    print(f"teacher pass: {result['teacher_tokens_per_s']:.0f} supervised tok/s "
          f"({result['teacher_s_per_conversation']:.2f} s/conversation) vs full logits "
          f"{result['teacher_full_logits_tokens_per_s']:.0f} tok/s: {result['teacher_speedup']:.2f}x")
    print(f"training: packed {result['train_packed_tokens_per_s']:.0f} vs flat "
          f"{result['train_flat_tokens_per_s']:.0f} supervised tok/s ({result['train_packed_over_flat']:.2f}x)")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
