"""Throughput on one model, through the project's own engine, with token ids for text.

- self-study: one chunk plan (`per_chunk` conversations per chunk, chunk-major) through
  bot A's questions and bot B's answers (`cartridges.core.generate`, lockstep batches of
  `gen_batch`, shared chunk prefills, bot B keeping its top-k: the teacher's targets),
  the teacher pass (`cartridges.core.targets.teacher_targets`, which the pipeline runs only
  when it cannot keep the targets from bot B) and one training epoch (packed groups of
  `accum`, Adam steps, behind a `p`-row cartridge: `cartridges.core.train`).
- time to first token: a question behind a `p`-row cartridge of a document, against the
  same question after the whole document in the prompt (median of alternating runs).
- decode: tokens/s of greedy generation behind the cartridge, 1 stream against 16.

Random weights never emit a stop token, so every stream runs its whole budget; in the
pipeline a lockstep group also runs until its longest stream ends, so the step counts
match. Each part runs once untimed at small sizes first (kernel selection, allocator).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from bench.gpu.shapes import random_ids
from cartridges.core.batch import Stream
from cartridges.core.cartridge import Cartridge
from cartridges.core.generate import generate
from cartridges.core.models import LoadedModel
from cartridges.core.prefix import capture_rows
from cartridges.core.sharing import SHARE_MIN
from cartridges.core.targets import teacher_targets
from cartridges.core.train import Example, group_backward, make_optimizer
from schemas.configs import ChunkConfig, SynthConfig, TeacherConfig, TrainConfig


@dataclasses.dataclass(frozen=True)
class Sizes:
    conversations: int
    gen_batch: int
    per_chunk: int
    chunk_min: int
    chunk_max: int
    instruction: int  # bot A's instruction after the chunk
    header: int  # chat-template tokens around a turn
    max_q: int
    max_a: int
    temperature_a: float
    keep_topk: int
    top_k: int
    top_mass: float
    p: int
    accum: int
    lr: float
    doc_tokens: int
    question: int
    ttft_repeats: int
    decode_new: int
    streams: int
    gate_p: int
    gate_suffix: int


def full_sizes() -> Sizes:
    """The pipeline's defaults (schemas.configs), two generation groups of conversations."""
    synth, chunk, teacher, train = SynthConfig(), ChunkConfig(), TeacherConfig(), TrainConfig()
    return Sizes(
        conversations=2 * synth.gen_batch, gen_batch=synth.gen_batch, per_chunk=chunk.per_chunk,
        chunk_min=chunk.chunk_min, chunk_max=chunk.chunk_max, instruction=24, header=4,
        max_q=synth.max_q, max_a=synth.max_a, temperature_a=synth.temperature_a, keep_topk=synth.keep_topk,
        top_k=teacher.top_k, top_mass=teacher.top_mass, p=train.p, accum=train.accum, lr=train.lr,
        doc_tokens=4096, question=24, ttft_repeats=7, decode_new=128, streams=16, gate_p=256, gate_suffix=128,
    )


def tiny_sizes() -> Sizes:
    """The same code paths at toy sizes (the CPU dry run)."""
    return dataclasses.replace(
        full_sizes(), conversations=14, gen_batch=7, chunk_min=40, chunk_max=48, instruction=6, max_q=6,
        max_a=8, p=32, doc_tokens=128, question=6, ttft_repeats=3, decode_new=6, gate_p=24,
        gate_suffix=16,
    )


def warmup_sizes(s: Sizes) -> Sizes:
    return dataclasses.replace(s, conversations=min(s.conversations, 2 * s.per_chunk), max_q=2, max_a=2,
                               ttft_repeats=1, decode_new=2)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable):
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def selfstudy(lm: LoadedModel, s: Sizes, seed: int = 0) -> dict:
    model, device = lm.model, lm.device
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    n_chunks = -(-s.conversations // s.per_chunk)
    chunks = [random_ids(int(torch.randint(s.chunk_min, s.chunk_max + 1, (1,), generator=gen)), vocab, gen)
              for _ in range(n_chunks)]
    chunk_of = [chunks[c // s.per_chunk] for c in range(s.conversations)]
    a_streams = [Stream(prompt=chunk_of[c] + random_ids(s.instruction, vocab, gen), max_new=s.max_q,
                        temperature=s.temperature_a, seed=c) for c in range(s.conversations)]
    a_out, a_s = timed(device, lambda: generate(model, a_streams, batch_size=s.gen_batch, share_min=SHARE_MIN))
    b_streams = [Stream(prompt=chunk_of[c] + random_ids(s.header, vocab, gen) + out.tokens + random_ids(s.header, vocab, gen),
                        max_new=s.max_a, keep_topk=s.keep_topk) for c, out in enumerate(a_out)]
    b_out, b_s = timed(device, lambda: generate(model, b_streams, batch_size=s.gen_batch, share_min=SHARE_MIN))

    sequences = [b.prompt + out.tokens for b, out in zip(b_streams, b_out, strict=True)]
    starts = [len(b.prompt) for b in b_streams]
    _, teacher_s = timed(device, lambda: teacher_targets(model, sequences, starts, s.top_k, s.top_mass,
                                                         share_min=SHARE_MIN))

    # The student sees the conversation without its chunk; the cartridge takes its place.
    examples = []
    for c, (seq, start, out) in enumerate(zip(sequences, starts, b_out, strict=True)):
        cut = len(chunk_of[c])
        examples.append(Example(c, seq[cut:], list(range(start - cut, len(seq) - cut)),
                                [ids for ids, _ in out.topk], [lp for _, lp in out.topk]))
    rows = capture_rows(model, torch.tensor(random_ids(s.p, vocab, gen), device=device))
    cart = Cartridge.from_rows([(k.float(), v.float()) for k, v in rows], frozen=s.p // 2)
    opt = make_optimizer(cart, s.lr)

    def epoch() -> None:
        for i in range(0, len(examples), s.accum):
            group_backward(model, [cart], examples[i : i + s.accum], packed=True)
            opt.step()
            opt.zero_grad(set_to_none=True)

    _, train_s = timed(device, epoch)
    generated = sum(len(o.tokens) for o in a_out) + sum(len(o.tokens) for o in b_out)
    supervised = sum(ex.n for ex in examples)
    synth_s = a_s + b_s
    n = s.conversations
    return {
        "conversations": n, "generated_tokens": generated, "supervised_tokens": supervised,
        "bot_a_s": round(a_s, 3), "bot_b_s": round(b_s, 3), "teacher_s": round(teacher_s, 3), "train_s": round(train_s, 3),
        "generate_tokens_per_s": round(generated / synth_s, 1),
        "teacher_tokens_per_s": round(supervised / teacher_s, 1),
        "train_tokens_per_s": round(supervised / train_s, 1),
        # The pipeline's default keeps the teacher's targets from bot B's decode (no teacher forward).
        "conversations_per_s": round(n / (synth_s + train_s), 3),
        "conversations_per_s_with_teacher_pass": round(n / (synth_s + teacher_s + train_s), 3),
    }


def ttft(lm: LoadedModel, s: Sizes, seed: int = 1) -> dict:
    model, device = lm.model, lm.device
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    doc = random_ids(s.doc_tokens, vocab, gen)
    rows = [(k.detach(), v.detach()) for k, v in capture_rows(model, torch.tensor(doc[: s.p], device=device))]
    times: dict[str, list[float]] = {"icl": [], "cartridge": []}
    for r in range(s.ttft_repeats):
        question = random_ids(s.question, vocab, gen)
        arms = [("icl", lambda q=question: generate(model, [Stream(doc + q, 1)], batch_size=1)),
                ("cartridge", lambda q=question: generate(model, [Stream(q, 1)], batch_size=1, prefix_rows=rows))]
        for name, fn in arms if r % 2 == 0 else arms[::-1]:
            times[name].append(timed(device, fn)[1])
    icl, cart = statistics.median(times["icl"]), statistics.median(times["cartridge"])
    per_row = sum(k.shape[0] * k.shape[2] * k.element_size() + v.shape[0] * v.shape[2] * v.element_size()
                  for k, v in rows)
    return {
        "doc_tokens": s.doc_tokens, "p": s.p, "question_tokens": s.question,
        "ttft_icl_ms": round(icl * 1000, 2), "ttft_cartridge_ms": round(cart * 1000, 2),
        "ttft_ratio": round(icl / cart, 2),
        "kv_bytes_icl": (s.doc_tokens + s.question) * per_row, "kv_bytes_cartridge": (s.p + s.question) * per_row,
    }


def decode(lm: LoadedModel, s: Sizes, seed: int = 2) -> dict:
    model, device = lm.model, lm.device
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    rows = [(k.detach(), v.detach()) for k, v in
            capture_rows(model, torch.tensor(random_ids(s.p, vocab, gen), device=device))]
    streams = [Stream(random_ids(s.question, vocab, gen), s.decode_new) for _ in range(s.streams)]
    one, one_s = timed(device, lambda: [generate(model, [st], batch_size=1, prefix_rows=rows)[0] for st in streams[:2]])
    many, many_s = timed(device, lambda: generate(model, streams, batch_size=s.streams, prefix_rows=rows))
    rate_one = sum(len(g.tokens) for g in one) / one_s
    rate_many = sum(len(g.tokens) for g in many) / many_s
    return {
        "p": s.p, "new_tokens": s.decode_new, "streams": s.streams,
        "decode_tokens_per_s_1": round(rate_one, 1), f"decode_tokens_per_s_{s.streams}": round(rate_many, 1),
        "concurrency_ratio": round(rate_many / rate_one, 2),
    }
