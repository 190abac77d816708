"""Speculative greedy decoding from prompt lookup: acceptance and net gain, with and without drafts.

Two places it could pay, both measured side by side in this process:

- synthesis: bot B over one fixed chunk plan (default configuration), `synth.spec_b`
  0 against K: seconds, bot B's acceptance, and whether every answer is the same;
- serving: one request at a time (the latency case), long answers grounded in a
  document behind that document's exact KV rows, drafting from the document's token
  ids (what `train --draft-ref` embeds) and the conversation: tokens/s with and without.

Prints a table; the last line is JSON. Run: `python -m bench.bench_spec [--corpus FILE] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch

import stages.synthesize as synthesize
from bench.plans import document_plan
from cartridges.core.batch import Stream
from cartridges.core.chat import end_of_turn_ids, without_system
from cartridges.core.generate import generate
from cartridges.core.models import load_model
from cartridges.core.prefix import capture_rows
from schemas import ChunkConfig, SynthConfig

QUESTIONS = (
    "Explain in detail, quoting the document, how leader election works.",
    "Describe, in the document's own words, how log replication works and when an entry is committed.",
    "List every persistent and volatile piece of server state the document names, with what each means.",
    "Summarize the section on safety, step by step, as the document states it.",
)


def synthesis_arm(lm, plan, contexts, synth: SynthConfig) -> tuple[float, list[dict], dict]:
    """Synthesis of the plan with bot B drafting `synth.spec_b` tokens; seconds, rows, acceptance."""
    counts = {"drafted": 0, "accepted": 0}
    original = synthesize.generate

    def counting(*args, **kwargs):
        out = original(*args, **kwargs)
        for g in out:
            counts["drafted"] += g.drafted
            counts["accepted"] += g.accepted
        return out

    synthesize.generate = counting
    try:
        t0 = time.perf_counter()
        rows = []
        for start in range(0, len(plan), synth.gen_batch):
            rows += synthesize.synthesize_group(lm, plan[start : start + synth.gen_batch],
                                                contexts[start : start + synth.gen_batch], synth)
        return time.perf_counter() - t0, rows, counts
    finally:
        synthesize.generate = original


def serving_arm(lm, rows, prompts: list[list[int]], reference: list[int], draft: int, max_new: int) -> dict:
    """One request at a time behind the document's rows; tokens/s and acceptance."""
    eot = tuple(end_of_turn_ids(lm.tokenizer))
    tokens, drafted, accepted, outputs = 0, 0, 0, []
    t0 = time.perf_counter()
    for prompt in prompts:
        [g] = generate(lm.model, [Stream(prompt, max_new, stop_ids=eot, draft=draft, draft_reference=reference)],
                       prefix_rows=rows)
        tokens += len(g.tokens)
        drafted += g.drafted
        accepted += g.accepted
        outputs.append(g.tokens)
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "drafted": drafted,
            "accepted": accepted, "acceptance": accepted / max(drafted, 1), "outputs": outputs}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default="docs/eval/raft.md")
    ap.add_argument("--conversations", type=int, default=70, help="planned conversations for the synthesis arm")
    ap.add_argument("--draft", type=int, default=3, help="draft tokens per step in the drafting arms")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    ap.add_argument("--max-new", type=int, default=200, help="serving: tokens per answer at most")
    ap.add_argument("--max-a", type=int, default=None, help="synthesis: bot B's budget (default: the config's)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the cores this process may use)")
    ap.add_argument("--skip-synthesis", action="store_true")
    ap.add_argument("--json", action="store_true", help="the last line is JSON (always so here)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(None, None, args.dtype)
    with open(args.corpus, encoding="utf-8") as f:
        text = f.read()
    doc = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    result: dict = {**lm.dtype_record(), "draft": args.draft, "corpus_tokens": len(doc)}

    if not args.skip_synthesis:
        plan, contexts = document_plan(lm.tokenizer, doc, ChunkConfig(conversations=args.conversations, heldout=0))
        synth = SynthConfig()
        synth = replace(synth, max_a=args.max_a or synth.max_a)
        plain_s, plain_rows, _ = synthesis_arm(lm, plan, contexts, synth)
        spec_s, spec_rows, counts = synthesis_arm(lm, plan, contexts, replace(synth, spec_b=args.draft))
        same = sum(a["answer"] == b["answer"] for a, b in zip(plain_rows, spec_rows, strict=True))
        result["synthesis"] = {
            "conversations": len(plan), "plain_s": round(plain_s, 2), "spec_s": round(spec_s, 2),
            "spec_over_plain": round(plain_s / spec_s, 3), "acceptance": round(counts["accepted"] / max(counts["drafted"], 1), 3),
            "drafted": counts["drafted"], "accepted": counts["accepted"], "same_answers": same,
        }
        result["synthesis_spec_over_plain"] = result["synthesis"]["spec_over_plain"]
        print(f"synthesis ({len(plan)} conversations): plain {plain_s:.1f} s, bot B drafting {args.draft}: "
              f"{spec_s:.1f} s ({plain_s / spec_s:.2f}x); acceptance {result['synthesis']['acceptance']:.0%} "
              f"of {counts['drafted']} drafted; {same}/{len(plan)} answers identical", flush=True)

    rows = capture_rows(lm.model, torch.tensor(doc, device=lm.device))
    prompts = [without_system(lm.tokenizer, [{"role": "system", "content": "-"}, {"role": "user", "content": q}],
                              add_generation_prompt=True) for q in QUESTIONS]
    plain = serving_arm(lm, rows, prompts, doc, 0, args.max_new)
    spec = serving_arm(lm, rows, prompts, doc, args.draft, args.max_new)
    result["serving"] = {
        "answers": len(prompts), "tokens": plain["tokens"], "plain_tokens_per_s": round(plain["tokens_per_s"], 2),
        "spec_tokens_per_s": round(spec["tokens_per_s"], 2),
        "spec_over_plain": round(spec["tokens_per_s"] / plain["tokens_per_s"], 3),
        "acceptance": round(spec["acceptance"], 3), "drafted": spec["drafted"], "accepted": spec["accepted"],
        "same_output": plain["outputs"] == spec["outputs"],
    }
    result["serving_spec_over_plain"] = result["serving"]["spec_over_plain"]
    print(f"serving ({len(prompts)} answers, {plain['tokens']} tokens, one at a time behind the document's rows): "
          f"plain {plain['tokens_per_s']:.1f} tok/s, drafting {args.draft}: {spec['tokens_per_s']:.1f} tok/s "
          f"({result['serving']['spec_over_plain']:.2f}x); acceptance {spec['acceptance']:.0%}; "
          f"same output: {result['serving']['same_output']}", flush=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
