"""A Dask worker's allocator: one synthesis shard with and without the nanny's malloc setting.

Dask's nanny spawns workers with MALLOC_TRIM_THRESHOLD_=65536, which also pins glibc's mmap
threshold, so every large tensor is mapped and page-faulted afresh; `flows.runners` spawns
the local workers without it. glibc reads the variable once, at start-up, so each arm is a
child process of its own: the same shard (the default synthesis config over one corpus's
first planned conversations) at the workers' one thread, once as Dask would spawn it and
once as the flow does. Prints both times and their ratio; the last line is JSON.

Run: `python -m bench.bench_workers [--corpus FILE] [--conversations 64] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import replace

NANNY = {"MALLOC_TRIM_THRESHOLD_": "65536"}  # distributed's default pre-spawn environment


def shard(corpus: str, conversations: int, dtype: str, max_a: int | None) -> dict:
    """The child: time one synthesis shard in this process (one thread, as a local worker)."""
    import torch

    import stages.synthesize as synthesize
    from bench.plans import answers_hash, document_plan
    from cartridges.core.models import load_model
    from cartridges.core.speed import dtype_name
    from schemas import ChunkConfig, SynthConfig

    torch.set_num_threads(1)
    lm = load_model(None, None, dtype)
    with open(corpus, encoding="utf-8") as f:
        ids = lm.tokenizer(f.read(), add_special_tokens=False)["input_ids"]
    plan, contexts = document_plan(lm.tokenizer, ids, ChunkConfig(conversations=conversations, heldout=0))
    synth = SynthConfig()
    synth = replace(synth, gen_batch=len(plan), max_a=max_a or synth.max_a)
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    rows = synthesize.synthesize_group(lm, plan, contexts, synth)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {"seconds": wall, "system_s": after.ru_stime - before.ru_stime, "rows": len(rows),
            "answers": answers_hash(rows),
            "dtype": dtype_name(lm.dtype)}


def arm(argv: list[str], extra_env: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in NANNY}
    proc = subprocess.run([sys.executable, "-m", "bench.bench_workers", *argv, "--child"],
                          env={**env, **extra_env}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_workers child failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default="docs/eval/raft.md")
    ap.add_argument("--conversations", type=int, default=64, help="the shard's conversations (one lockstep group)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    ap.add_argument("--max-a", type=int, default=None, help="bot B's budget (default: the config's)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help="the last line is JSON (always so here)")
    args = ap.parse_args(argv)
    if args.conversations < 1:
        ap.error(f"--conversations must be at least 1, got {args.conversations}")
    if args.child:
        print(json.dumps(shard(args.corpus, args.conversations, args.dtype, args.max_a)), flush=True)
        return None
    passed = [a for a in argv if a != "--json"]
    flow, nanny = arm(passed, {}), arm(passed, NANNY)  # the same shard, so the same rows
    ratio = nanny["seconds"] / flow["seconds"]
    print(f"one synthesis shard, {flow['rows']} conversations, {flow['dtype']}, 1 thread: "
          f"{flow['seconds']:.1f} s as the flow spawns workers ({flow['system_s']:.1f} s system), "
          f"{nanny['seconds']:.1f} s with MALLOC_TRIM_THRESHOLD_=65536 ({nanny['system_s']:.1f} s system): "
          f"{ratio:.2f}x")
    result = {"flow_over_nanny_malloc": round(ratio, 3), "flow_s": round(flow["seconds"], 2),
              "nanny_malloc_s": round(nanny["seconds"], 2), "flow_system_s": round(flow["system_s"], 2),
              "nanny_malloc_system_s": round(nanny["system_s"], 2), "conversations": flow["rows"],
              "dtype": flow["dtype"], "same_answers": flow["answers"] == nanny["answers"]}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
