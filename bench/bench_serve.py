"""Serving behind a cartridge vs the document in the prompt, and batched vs one-at-a-time requests.

In one process on the default model and a real document of at least 4,000 tokens:
- time to first token (median over the questions): the document in the prompt
  (tokenize + prefill of the document, truncated to fit the context with the question
  and the answer budget, + question) vs the question behind an already loaded cartridge;
  loading the cartridge file from disk is reported separately;
- KV bytes one request holds (prompt + answer budget) in each case;
- aggregate decode tokens/s of the running server (HTTP on loopback) with
  `--concurrency` requests at once vs one at a time.
Without `--cartridge`, a corpus-initialized cartridge of `--p` rows is written to a
temporary file (untrained rows time exactly like trained ones).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from cartridges.core.batch import Stream
from cartridges.core.cartridge import compose_rows, init_from_corpus
from cartridges.core.chat import chat_ids
from cartridges.core.corpus import corpus_text
from cartridges.core.files import check_fits, load_cartridge, save_cartridge
from cartridges.core.generate import generate
from cartridges.core.models import load_model
from server.main import Server
from server.options import ServeConfig
from server.selector import CartridgeSelector, render_prompt

DEFAULT_DOCS = ["README.md", "docs/PIPELINE.md", "docs/SERVE.md", "docs/corpus/deflate.md"]
QUESTIONS = [
    "What does the teacher stage keep for each answer token?",
    "Where are the artifacts of a run stored?",
    "How does the server batch concurrent requests?",
    "What does the equivalence gate compare?",
    "Which model is the default, and how is it loaded?",
    "What happens when a client disconnects mid-stream?",
    "How are several cartridges composed?",
]
MIN_DOC_TOKENS = 4000


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def icl_ids(lm, doc_ids: list[int], question: str, budget: int, window: int) -> list[int]:
    """Tokenize the document + question, cutting the document to fit `window` tokens with the answer budget."""
    tok = lm.tokenizer
    overhead = len(chat_ids(tok, [{"role": "system", "content": ""}, {"role": "user", "content": question}],
                            add_generation_prompt=True))
    keep = min(len(doc_ids), window - overhead - budget)
    text = tok.decode(doc_ids[:keep])
    return chat_ids(tok, [{"role": "system", "content": text}, {"role": "user", "content": question}],
                    add_generation_prompt=True)


def kv_bytes_per_token(fingerprint: dict, dtype: torch.dtype) -> int:
    size = torch.empty(0, dtype=dtype).element_size()
    return sum(hk * dk + hv * dv for hk, dk, hv, dv in fingerprint["layers"]) * size


def throughput(url: str, model: str, questions: list[str], concurrency: int, max_new: int) -> tuple[int, float]:
    """Completion tokens and wall seconds for `questions` sent `concurrency` at a time over HTTP."""
    def ask(q: str) -> int:
        body = {"model": model, "messages": [{"role": "user", "content": q}], "max_tokens": max_new, "temperature": 0}
        resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        resp.raise_for_status()
        return resp.json()["usage"]["completion_tokens"]

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(ask, questions))
    return tokens, time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--doc", action="append", help=f"document(s) (default: {' '.join(DEFAULT_DOCS)})")
    ap.add_argument("--cartridge", default=None, help="a trained cartridge (default: corpus-initialized, --p rows)")
    ap.add_argument("--p", type=int, default=256)
    ap.add_argument("--questions", type=int, default=5, help="questions timed per TTFT arm (>= 5)")
    ap.add_argument("--max-new", type=int, default=64, help="answer budget (ICL truncation and decode arms)")
    ap.add_argument("--window", type=int, default=None,
                    help="ICL prompt limit in tokens (default: the model's context window)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--sequential", type=int, default=4, help="requests sent one at a time for the 1-request arm")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the cores this process may use)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (bfloat16 there)")
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(None, args.device)
    tok = lm.tokenizer
    docs = args.doc or DEFAULT_DOCS
    text = corpus_text(docs)
    doc_ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(doc_ids) < MIN_DOC_TOKENS:
        raise SystemExit(f"the document has {len(doc_ids)} tokens; this benchmark needs at least {MIN_DOC_TOKENS}")

    tmp = tempfile.TemporaryDirectory()
    path = args.cartridge
    if path is None:
        path = save_cartridge(Path(tmp.name) / "bench.safetensors", init_from_corpus(lm, text, args.p), lm.fingerprint)

    def load_file():
        cart = load_cartridge(path, device=lm.device, dtype=lm.dtype)
        check_fits(cart, lm.fingerprint, str(path))
        with torch.no_grad():
            return [(k.detach(), v.detach()) for k, v in compose_rows([cart])], cart.p

    load_times = []
    for _ in range(3):
        (rows, p), seconds = timed(load_file)
        load_times.append(seconds)

    window = min(args.window or lm.context_length, lm.context_length)
    questions = (QUESTIONS * (args.questions // len(QUESTIONS) + 1))[: max(args.questions, 5)]
    generate(lm.model, [Stream(render_prompt(tok, [{"role": "user", "content": "warm up"}]), 2)], prefix_rows=rows)

    # TTFT: both arms per question, alternating which goes first, so load bursts hit both.
    ttft = {"icl": [], "cartridge": []}
    icl_lengths, cart_lengths = [], []

    def icl_first(q: str):
        ids = icl_ids(lm, doc_ids, q, args.max_new, window)
        icl_lengths.append(len(ids))
        return generate(lm.model, [Stream(ids, 1)], batch_size=1)

    def cart_first(q: str):
        ids = render_prompt(tok, [{"role": "user", "content": q}])
        cart_lengths.append(len(ids))
        return generate(lm.model, [Stream(ids, 1)], batch_size=1, prefix_rows=rows)

    for i, q in enumerate(questions):
        arms = [("icl", icl_first), ("cartridge", cart_first)]
        for name, fn in arms if i % 2 == 0 else arms[::-1]:
            ttft[name].append(timed(lambda fn=fn, q=q: fn(q))[1])
    ttft_icl, ttft_cart = statistics.median(ttft["icl"]), statistics.median(ttft["cartridge"])

    per_token = kv_bytes_per_token(lm.fingerprint, lm.dtype)
    kv_icl = (statistics.median(icl_lengths) + args.max_new) * per_token
    kv_cart = (p + statistics.median(cart_lengths) + args.max_new) * per_token

    # Decode throughput of the running server: concurrent requests vs one at a time.
    selector = CartridgeSelector(lm, [str(path)], name="bench")
    load_before = os.getloadavg()[0]
    with Server(lm, selector, ServeConfig(port=0, max_batch=args.concurrency, max_tokens_cap=args.max_new)) as srv:
        throughput(srv.url, "bench", questions[:1], 1, 4)  # warm the HTTP path
        many = [QUESTIONS[i % len(QUESTIONS)] + f" ({i})" for i in range(args.concurrency)]
        seq_tokens, seq_s = throughput(srv.url, "bench", many[: args.sequential], 1, args.max_new)
        con_tokens, con_s = throughput(srv.url, "bench", many, args.concurrency, args.max_new)
        peak = srv.engine.stats()["peak_active"]
    load_after = os.getloadavg()[0]
    rate_seq, rate_con = seq_tokens / seq_s, con_tokens / con_s

    rows_out = [
        ("document tokens (whole)", f"{len(doc_ids)}"),
        ("ICL prompt tokens (median, truncated to fit)", f"{statistics.median(icl_lengths):.0f}"),
        ("cartridge rows + question tokens (median)", f"{p} + {statistics.median(cart_lengths):.0f}"),
        ("TTFT ICL (tokenize + prefill), median", f"{ttft_icl * 1000:.0f} ms"),
        ("TTFT behind loaded cartridge, median", f"{ttft_cart * 1000:.0f} ms"),
        ("TTFT ratio ICL / cartridge", f"{ttft_icl / ttft_cart:.1f}x"),
        ("cartridge file load (median of 3)", f"{statistics.median(load_times) * 1000:.0f} ms"),
        (f"KV bytes/request ICL (prompt + {args.max_new})", f"{kv_icl / 2**20:.1f} MiB"),
        (f"KV bytes/request cartridge (p + question + {args.max_new})", f"{kv_cart / 2**20:.1f} MiB"),
        ("KV ratio ICL / cartridge", f"{kv_icl / kv_cart:.1f}x"),
        (f"decode tok/s, {args.sequential} requests one at a time", f"{rate_seq:.1f} ({seq_tokens} in {seq_s:.1f} s)"),
        (f"decode tok/s, {args.concurrency} concurrent (peak batch {peak})",
         f"{rate_con:.1f} ({con_tokens} in {con_s:.1f} s)"),
        ("concurrency throughput ratio", f"{rate_con / rate_seq:.2f}x"),
    ]
    width = max(len(k) for k, _ in rows_out)
    print(f"model {lm.name}, {torch.get_num_threads()} threads, {lm.device}; docs {' '.join(map(str, docs))}; "
          f"1-min load average {load_before:.1f} -> {load_after:.1f}")
    for key, value in rows_out:
        print(f"{key:<{width}}  {value}")
    result = {
        "model": lm.name, "threads": torch.get_num_threads(), "docs": [str(d) for d in docs],
        "doc_tokens": len(doc_ids), "p": p, "cartridge": str(args.cartridge or "corpus-init"),
        "questions": len(questions), "max_new": args.max_new, "window": window,
        "icl_prompt_tokens": statistics.median(icl_lengths), "question_tokens": statistics.median(cart_lengths),
        "ttft_icl_ms": round(ttft_icl * 1000, 1), "ttft_cartridge_ms": round(ttft_cart * 1000, 1),
        "ttft_ratio": round(ttft_icl / ttft_cart, 2),
        "ttft_icl_all_ms": [round(t * 1000, 1) for t in ttft["icl"]],
        "ttft_cartridge_all_ms": [round(t * 1000, 1) for t in ttft["cartridge"]],
        "cartridge_load_ms": round(statistics.median(load_times) * 1000, 1),
        "kv_bytes_icl": int(kv_icl), "kv_bytes_cartridge": int(kv_cart), "kv_bytes_ratio": round(kv_icl / kv_cart, 2),
        "sequential_requests": args.sequential, "sequential_tokens": seq_tokens, "sequential_seconds": round(seq_s, 2),
        "concurrent_requests": args.concurrency, "concurrent_tokens": con_tokens, "concurrent_seconds": round(con_s, 2),
        "peak_batch": peak, "decode_tokens_per_s_1": round(rate_seq, 2),
        "decode_tokens_per_s_concurrent": round(rate_con, 2),
        "concurrency_throughput_ratio": round(rate_con / rate_seq, 2),
        "load_average": [round(load_before, 2), round(load_after, 2)],
    }
    if args.json:
        print(json.dumps(result))
    tmp.cleanup()
    return result


if __name__ == "__main__":
    main()
