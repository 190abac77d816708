"""Self-study throughput: the pipeline against a plain `transformers` reference, one chunk plan.

Both paths take the same fixed chunk plan (default configuration) through synthesis, the
teacher pass and one training epoch, in this process:

- pipeline: the stages as they run (chunk-major shared prefills, the lockstep batch
  engine, teacher targets behind the shared chunk, packed training) in `--dtype`;
- reference: the same stage logic with `transformers` `generate` at batch 16 for bots A
  and B, a float32 teacher pass that prefills chunk plus conversation for every
  conversation, and float32 flat training.

Prints conversations per hour for each path, their ratio and a per-stage breakdown; the
last line is JSON. Run: `python -m bench.bench_pipeline [--corpus FILE] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from contextlib import contextmanager
from dataclasses import replace

import pyarrow as pa
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import stages.synthesize as synthesize
import stages.teacher as teacher
from bench.plans import document_plan
from cartridges.core.batch import Stream
from cartridges.core.cartridge import init_cartridge
from cartridges.core.generate import Generation
from cartridges.core.models import LoadedModel, load_model
from cartridges.core.train import group_backward, make_optimizer
from schemas import TABLES, ChunkConfig, SynthConfig, TeacherConfig, TrainConfig
from stages.train import load_examples

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class _RowStops(StoppingCriteria):
    """Per-row stop sets: a row is done once its last token is one of its own stop ids."""

    def __init__(self, stops: list[set[int]]) -> None:
        self.stops = stops

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        last = input_ids[:, -1].tolist()
        return torch.tensor([t in s for t, s in zip(last, self.stops, strict=True)], device=input_ids.device)


def hf_generate(model: torch.nn.Module, streams: list[Stream], batch_size: int = 16, **_) -> list[Generation]:
    """`transformers` generate over left-padded groups of `batch_size`; same stops, same budgets."""
    out: list[Generation] = []
    for start in range(0, len(streams), batch_size):
        group = streams[start : start + batch_size]
        width = max(len(s.prompt) for s in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for r, s in enumerate(group):
            ids[r, width - len(s.prompt):] = torch.tensor(s.prompt)
            mask[r, width - len(s.prompt):] = 1
        sample = group[0].temperature > 0
        torch.manual_seed(group[0].seed)
        with torch.no_grad():
            gen = model.generate(
                input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                max_new_tokens=max(s.max_new for s in group),
                do_sample=sample, temperature=group[0].temperature if sample else None, top_p=None, top_k=None,
                stopping_criteria=StoppingCriteriaList([_RowStops([set(s.stop_ids) for s in group])]),
                pad_token_id=0,
            )
        for r, s in enumerate(group):
            tokens = gen[r, width:].tolist()[: s.max_new]
            end = next((i + 1 for i, t in enumerate(tokens) if t in s.stop_ids), None)
            out.append(Generation(tokens=tokens[:end] if end else tokens, finished="stop" if end else "length"))
    return out


@contextmanager
def reference_paths():
    """Run the stage logic with HF generate and unshared teacher prefills."""
    saved = synthesize.generate, synthesize.SHARE_MIN, teacher.SHARE_MIN
    synthesize.generate, synthesize.SHARE_MIN, teacher.SHARE_MIN = hf_generate, 0, 0
    try:
        yield
    finally:
        synthesize.generate, synthesize.SHARE_MIN, teacher.SHARE_MIN = saved


def run_path(lm: LoadedModel, plan: list[dict], contexts: list[str], text: str, synth: SynthConfig,
             train_cfg: TrainConfig, log) -> dict:
    """Synthesis, teacher pass and one training epoch over `plan`; wall seconds and token counts."""
    t0 = time.perf_counter()
    convs = []
    for start in range(0, len(plan), synth.gen_batch):
        convs += synthesize.synthesize_group(lm, plan[start : start + synth.gen_batch],
                                             contexts[start : start + synth.gen_batch], synth)
        log(f"  synthesized {len(convs)}/{len(plan)}")
    t_synth = time.perf_counter() - t0
    usable = [c for c in convs if teacher.usable(c)]

    t0 = time.perf_counter()
    targets = teacher.target_rows(lm, usable, TeacherConfig())
    t_teacher = time.perf_counter() - t0

    train, _ = load_examples(pa.Table.from_pylist(usable, schema=TABLES["conversations"]),
                             pa.Table.from_pylist(targets, schema=TABLES["targets"]))
    cart = init_cartridge(lm, text, "corpus", train_cfg.p, train_cfg.frozen)
    opt = make_optimizer(cart, train_cfg.lr)
    t0 = time.perf_counter()
    for i in range(0, len(train), train_cfg.accum):
        opt.zero_grad(set_to_none=True)
        group_backward(lm.model, [cart], train[i : i + train_cfg.accum], packed=train_cfg.pack)
        opt.step()
    t_train = time.perf_counter() - t0

    generated = sum(c["q_tokens"] + c["a_tokens"] for c in convs)
    supervised = len(targets)
    total = t_synth + t_teacher + t_train
    return {
        "conversations": len(plan), "usable": len(usable),
        "a_well_formed": sum(c["a_ok"] for c in convs) / len(convs),
        "b_degenerate": sum(not c["b_ok"] for c in convs if c["a_ok"]) / max(sum(c["a_ok"] for c in convs), 1),
        "synthesis_s": t_synth, "teacher_s": t_teacher, "train_s": t_train, "total_s": total,
        "s_per_conversation": total / len(plan), "conversations_per_hour": 3600 * len(plan) / total,
        "synthesis_tokens_per_s": generated / t_synth, "teacher_tokens_per_s": supervised / max(t_teacher, 1e-9),
        "train_tokens_per_s": supervised / max(t_train, 1e-9), "supervised_tokens": supervised,
        "generated_tokens": generated,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default="docs/eval/raft.md")
    ap.add_argument("--conversations", type=int, default=70, help="planned conversations (10 spans of 7)")
    ap.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                    help="the pipeline path's dtype (default: the fastest on this machine)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the cores this process may use)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda; the reference runs on the same device")
    ap.add_argument("--max-a", type=int, default=None, help="bot B's budget (default: the config's)")
    ap.add_argument("--max-q", type=int, default=None, help="bot A's budget (default: the config's)")
    ap.add_argument("--gen-batch", type=int, default=None, help="the pipeline's generation width (default: the config's)")
    ap.add_argument("--per-chunk", type=int, default=None, help="conversations per span (default: the config's)")
    ap.add_argument("--spec-b", type=int, default=None, help="bot B's draft tokens per step (default: the config's)")
    ap.add_argument("--no-reference", action="store_true", help="time the pipeline path only")
    ap.add_argument("--json", action="store_true", help="the last line is JSON (always so here)")
    args = ap.parse_args(argv)
    say = print
    log = lambda line: print(line, flush=True)  # noqa: E731
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(None, args.device, args.dtype)
    ref_lm = lm if lm.dtype == torch.float32 else load_model(None, args.device, torch.float32)
    with open(args.corpus, encoding="utf-8") as f:
        text = f.read()
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    chunk_cfg = ChunkConfig(conversations=args.conversations, heldout=0)
    chunk_cfg = chunk_cfg.replace(per_chunk=args.per_chunk or chunk_cfg.per_chunk)
    plan, contexts = document_plan(lm.tokenizer, ids, chunk_cfg)
    synth = SynthConfig()
    synth = replace(synth, max_a=args.max_a or synth.max_a, max_q=args.max_q or synth.max_q)
    ref_synth = replace(synth, gen_batch=16, keep_topk=0)  # batch 16, and a teacher pass of its own
    synth = replace(synth, gen_batch=args.gen_batch or synth.gen_batch,
                    spec_b=synth.spec_b if args.spec_b is None else args.spec_b)
    train_cfg = TrainConfig()

    load_before = os.getloadavg()[0]
    log(f"pipeline ({lm.dtype_record()['dtype']}): {len(plan)} conversations over {len(ids)} tokens, "
        f"{chunk_cfg.per_chunk} per chunk")
    ours = run_path(lm, plan, contexts, text, synth, train_cfg, log)
    ref = None
    if not args.no_reference:
        log("reference (transformers generate, float32, unshared prefills, flat training)")
        with reference_paths():
            ref = run_path(ref_lm, plan, contexts, text, ref_synth, replace(train_cfg, pack=False), log)
    load_after = os.getloadavg()[0]

    for name, r in (("pipeline", ours), ("reference", ref)):
        if r is None:
            continue
        say(f"{name:9s}: {r['conversations_per_hour']:.0f} conversations/hour, {r['s_per_conversation']:.2f} s each "
            f"(synthesis {r['synthesis_s']:.1f} s at {r['synthesis_tokens_per_s']:.1f} tok/s, teacher "
            f"{r['teacher_s']:.1f} s at {r['teacher_tokens_per_s']:.0f} tok/s, train {r['train_s']:.1f} s at "
            f"{r['train_tokens_per_s']:.0f} tok/s); {r['usable']} usable, bot A well formed "
            f"{r['a_well_formed']:.0%}, bot B degenerate {r['b_degenerate']:.0%}")
    ratio = ours["conversations_per_hour"] / ref["conversations_per_hour"] if ref else math.nan
    if ref:
        say(f"pipeline / reference = {ratio:.2f}x; 1-min load average {load_before:.1f} before, {load_after:.1f} after")
    result = {
        "conversations_per_hour": round(ours["conversations_per_hour"], 1),
        "reference_conversations_per_hour": round(ref["conversations_per_hour"], 1) if ref else None,
        "pipeline_over_reference": round(ratio, 3) if ref else None,
        "s_per_conversation": round(ours["s_per_conversation"], 3),
        "synthesis_tokens_per_s": round(ours["synthesis_tokens_per_s"], 2),
        "teacher_tokens_per_s": round(ours["teacher_tokens_per_s"], 2),
        "train_tokens_per_s": round(ours["train_tokens_per_s"], 2),
        **lm.dtype_record(),
        "device": str(lm.device),
        "per_chunk": chunk_cfg.per_chunk,
        "gen_batch": synth.gen_batch,
        "spec_b": synth.spec_b,
        "corpus_tokens": len(ids),
        "threads": torch.get_num_threads(),
        "load_average": [round(load_before, 2), round(load_after, 2)],
        "pipeline": {k: round(v, 4) if isinstance(v, float) else v for k, v in ours.items()},
        "reference": {k: round(v, 4) if isinstance(v, float) else v for k, v in ref.items()} if ref else None,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
