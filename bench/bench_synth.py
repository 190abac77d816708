"""Throughput of lockstep batched generation on self-study-shaped prompts.

Compares, in one process on the default model, batched `generate` against the same
streams one at a time and against HF `model.generate` on the same left-padded batch,
all greedy and all producing exactly `--max-new` tokens per stream.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from cartridges.core.batch import Stream
from cartridges.core.chat import chat_ids, end_of_turn_ids
from cartridges.core.generate import generate
from cartridges.core.models import load_model

INSTRUCTION = "\n\nWrite one specific question that this text answers."


def build_prompts(tok, text: str, count: int, chunk: int) -> list[list[int]]:
    """`count` chat prompts over chunks at evenly spread offsets (overlapping if the text is short)."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    chunk = min(chunk, len(ids))
    last = len(ids) - chunk
    offsets = [round(i * last / max(count - 1, 1)) for i in range(count)]
    return [
        chat_ids(
            tok,
            [{"role": "user", "content": tok.decode(ids[o : o + chunk]) + INSTRUCTION}],
            add_generation_prompt=True,
        )
        for o in offsets
    ]


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def hf_generate(model, tok, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    tok.padding_side = "left"
    batch = tok.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    with torch.no_grad():
        out = model.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            do_sample=False,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            pad_token_id=pad,
            temperature=None,
            top_p=None,
            top_k=None,
        )
    return out[:, batch["input_ids"].shape[1] :].tolist()


def agreement(ours: list[list[int]], theirs: list[list[int]], ends: set[int]) -> float:
    """Share of our tokens, up to our first end-of-turn, that HF reproduced before diverging.

    HF is forced past end-of-turn by `min_new_tokens`, so only the part before it can agree.
    """
    agreed = total = 0
    for a, b in zip(ours, theirs, strict=True):
        cut = next((i + 1 for i, t in enumerate(a) if t in ends), len(a))
        total += cut
        for x, y in zip(a[:cut], b, strict=False):
            if x != y:
                break
            agreed += 1
    return agreed / max(total, 1)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default="docs/corpus/deflate.md")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=300, help="chunk length in tokens")
    ap.add_argument("--sequential", type=int, default=4, help="streams run one at a time (0 = all)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the cores this process may use)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="each arm runs this often, in rotated order; the fastest run counts")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(None, "cpu")
    model, tok = lm.model, lm.tokenizer
    with open(args.corpus, encoding="utf-8") as f:
        prompts = build_prompts(tok, f.read(), args.streams, args.chunk)
    streams = [Stream(p, max_new=args.max_new) for p in prompts]
    n_seq = len(streams) if args.sequential <= 0 else min(args.sequential, len(streams))
    say = (lambda *_: None) if args.json else print

    # Warm both paths so one-time costs (allocator, kernels) do not land on the first arm.
    generate(model, [Stream(prompts[0], max_new=2)])
    hf_generate(model, tok, prompts[:2], 2)

    seq_streams = streams[:: max(len(streams) // n_seq, 1)][:n_seq]
    firsts = [Stream(s.prompt, max_new=1) for s in streams]
    seq_firsts = [Stream(s.prompt, max_new=1) for s in seq_streams]
    arms = {
        "batched": lambda: generate(model, streams, batch_size=len(streams)),
        "sequential": lambda: generate(model, seq_streams, batch_size=1),
        "hf_generate": lambda: hf_generate(model, tok, prompts, args.max_new),
        # One new token each: the prefill alone, which batching cannot amortize.
        "batched_prefill": lambda: generate(model, firsts, batch_size=len(firsts)),
        "sequential_prefill": lambda: generate(model, seq_firsts, batch_size=1),
    }
    # Other work on a shared machine comes and goes; rotating the order and keeping each
    # arm's fastest run keeps a burst of it from landing on one arm only.
    load_before = os.getloadavg()[0]
    times: dict[str, list[float]] = {name: [] for name in arms}
    outputs: dict[str, object] = {}
    names = list(arms)
    for r in range(max(args.rounds, 1)):
        for name in names[r % len(names):] + names[: r % len(names)]:
            outputs[name], seconds = timed(arms[name])
            times[name].append(seconds)
    load_after = os.getloadavg()[0]
    batched, hf = outputs["batched"], outputs["hf_generate"]
    t_batched, t_seq, t_hf, p_batched, p_seq = (min(times[n]) for n in names)

    tokens = sum(len(g.tokens) for g in batched)
    seq_tokens = n_seq * args.max_new
    hf_tokens = sum(len(h) for h in hf)
    rate_b = tokens / t_batched
    rate_s = seq_tokens / t_seq
    rate_h = hf_tokens / t_hf
    decode_b = (tokens - len(streams)) / max(t_batched - p_batched, 1e-9)
    decode_s = (seq_tokens - n_seq) / max(t_seq - p_seq, 1e-9)
    agree = agreement([g.tokens for g in batched], hf, set(end_of_turn_ids(tok)))

    lengths = [len(p) for p in prompts]
    say(f"model {lm.name}, {torch.get_num_threads()} threads, {len(streams)} prompts of "
        f"{min(lengths)}-{max(lengths)} tokens, {args.max_new} new tokens each, greedy")
    say(f"batched    generate (batch {len(streams)}): {tokens} tokens in {t_batched:.2f} s = {rate_b:.1f} tok/s")
    say(f"sequential generate (batch 1): {seq_tokens} tokens in {t_seq:.2f} s = {rate_s:.1f} tok/s"
        + (f" (measured on {n_seq} of {len(streams)} streams; "
           f"extrapolated {len(streams) * t_seq / n_seq:.1f} s for all)" if n_seq < len(streams) else ""))
    say(f"HF model.generate (batch {len(streams)}, left-padded): {hf_tokens} tokens in {t_hf:.2f} s "
        f"= {rate_h:.1f} tok/s")
    say(f"batched / sequential = {rate_b / rate_s:.2f}x, batched / HF generate = {rate_b / rate_h:.2f}x")
    say(f"prefill (first token) {p_batched:.2f} s batched, {p_seq / n_seq:.2f} s per stream alone; "
        f"decode alone {decode_b:.1f} vs {decode_s:.1f} tok/s = {decode_b / decode_s:.2f}x")
    say(f"greedy tokens (up to end of turn) identical to HF's before the first divergence: {agree:.1%}")
    say("all runs (s): " + ", ".join(f"{n} {' '.join(f'{t:.1f}' for t in ts)}" for n, ts in times.items())
        + f"; 1-min load average {load_before:.1f} before, {load_after:.1f} after")
    result = {
        "model": lm.name,
        "threads": torch.get_num_threads(),
        "streams": len(streams),
        "max_new": args.max_new,
        "prompt_tokens": [min(lengths), max(lengths)],
        "sequential_streams_measured": n_seq,
        "batched_tokens_per_s": round(rate_b, 2),
        "sequential_tokens_per_s": round(rate_s, 2),
        "hf_generate_tokens_per_s": round(rate_h, 2),
        "batched_over_sequential": round(rate_b / rate_s, 3),
        "batched_over_hf_generate": round(rate_b / rate_h, 3),
        "batched_seconds": round(t_batched, 3),
        "sequential_seconds": round(t_seq, 3),
        "hf_generate_seconds": round(t_hf, 3),
        "batched_prefill_seconds": round(p_batched, 3),
        "sequential_prefill_seconds_per_stream": round(p_seq / n_seq, 3),
        "decode_batched_over_sequential": round(decode_b / decode_s, 3),
        "rounds": max(args.rounds, 1),
        "load_average": [round(load_before, 2), round(load_after, 2)],
        "greedy_agreement_with_hf": round(agree, 4),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
