"""Synthesis shards side by side in this process against one after another on all its threads.

The in-process fanout (`stages.fanout.in_process`) runs shards on one Python thread per
core, each at one torch thread, instead of one shard at a time on every thread. Both arms
use every core this process may use (the machine should be otherwise idle), and
take the same shards of one corpus's planned conversations (default synthesis config, one
shard per thread) in this process; the arms alternate twice so that the machine's drift
hits both. Prints both times and their ratio; the last line is JSON.

Run: `python -m bench.bench_fanout [--corpus FILE] [--conversations 32] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace

import torch

import stages.synthesize as synthesize
from bench.plans import answers_hash, document_plan
from cartridges.core.models import LoadedModel, load_model
from cartridges.core.speed import dtype_name
from schemas import ChunkConfig, SynthConfig
from stages.fanout import in_process


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default="docs/eval/raft.md")
    ap.add_argument("--conversations", type=int, default=32, help="split into one shard per thread")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    ap.add_argument("--max-a", type=int, default=None, help="bot B's budget (default: the config's)")
    ap.add_argument("--rounds", type=int, default=2, help="times each arm runs, alternating")
    ap.add_argument("--json", action="store_true", help="the last line is JSON (always so here)")
    args = ap.parse_args(argv)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(2, cores)  # on one core the two arms still run, sharing it (the product would not fan out)
    torch.set_num_threads(threads)
    reason = f"{cores} core{'s' * (cores != 1)} this process may use"
    if args.conversations < threads:
        ap.error(f"--conversations must be at least the {threads} threads, got {args.conversations}")
    lm: LoadedModel = load_model(None, "cpu", args.dtype)
    with open(args.corpus, encoding="utf-8") as f:
        ids = lm.tokenizer(f.read(), add_special_tokens=False)["input_ids"]
    plan, contexts = document_plan(lm.tokenizer, ids, ChunkConfig(conversations=args.conversations, heldout=0))
    size = -(-len(plan) // threads)
    synth = SynthConfig()
    synth = replace(synth, gen_batch=size, max_a=args.max_a or synth.max_a)
    shards = [(plan[i : i + size], contexts[i : i + size]) for i in range(0, len(plan), size)]
    fanout = in_process(lm)

    def one_after_another() -> list[list[dict]]:
        return [synthesize.synthesize_group(lm, chunks, ctx, synth) for chunks, ctx in shards]

    def side_by_side() -> list[list[dict]]:
        return fanout.map(lambda shard: synthesize.synthesize_group(lm, shard[0], shard[1], synth), shards)

    seconds = {"sequential": 0.0, "side_by_side": 0.0}
    rows = {}
    for _ in range(args.rounds):
        for name, arm in (("sequential", one_after_another), ("side_by_side", side_by_side)):
            start = time.perf_counter()
            rows[name] = arm()
            seconds[name] += time.perf_counter() - start
    assert torch.get_num_threads() == threads
    ratio = seconds["sequential"] / seconds["side_by_side"]
    n = len(plan)
    print(f"{n} conversations in {len(shards)} shards, {dtype_name(lm.dtype)}, {threads} threads ({reason}): "
          f"{seconds['sequential'] / args.rounds:.1f} s one after another on {threads} threads, "
          f"{seconds['side_by_side'] / args.rounds:.1f} s side by side on one thread each: {ratio:.2f}x")
    result = {"side_by_side_over_sequential": round(ratio, 3),
              "sequential_s_per_conversation": round(seconds["sequential"] / args.rounds / n, 3),
              "side_by_side_s_per_conversation": round(seconds["side_by_side"] / args.rounds / n, 3),
              "conversations": n, "shards": len(shards), "threads": threads, "dtype": dtype_name(lm.dtype),
              "same_answers": answers_hash(sum(rows["sequential"], [])) == answers_hash(sum(rows["side_by_side"], []))}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
