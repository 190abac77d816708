"""Every benchmark in one command: one table of ratios, measured side by side in this run.

Each benchmark runs in its own process (its own model load and thread setting) and
reports a JSON object; the table keeps the ratios and their raw figures, goes to the
terminal, to the catalog (``benchmarks`` table) and to ``docs/BENCHMARKS.md``.
``--quick`` shrinks every benchmark so the whole command takes a few minutes (tests
use it; its figures are too small to quote).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa

from schemas import BENCHMARKS
from storage import StageContext, Store


@dataclass(frozen=True)
class Bench:
    name: str
    module: str
    args: tuple[str, ...]
    quick: tuple[str, ...]
    ratios: tuple[tuple[str, str, str], ...]  # (json key, what it compares, goal)
    raw: tuple[str, ...] = ()


BENCHES = (
    Bench("synthesis", "bench.bench_synth", ("--max-new", "160"),
          ("--max-new", "8", "--streams", "4", "--sequential", "2", "--rounds", "1", "--chunk", "64"),
          (("batched_over_sequential", "batched generation vs one stream at a time", ">= 4x"),
           ("batched_over_hf_generate", "batched generation vs transformers generate", ">= 1x")),
          ("batched_tokens_per_s", "sequential_tokens_per_s", "hf_generate_tokens_per_s")),
    Bench("teacher+train", "bench.bench_train", (),
          ("--conversations", "2", "--batch", "2", "--accum", "2", "--p", "16"),
          (("teacher_speedup", "teacher pass (top-k of supervised rows) vs full logits", "> 1x"),
           ("train_packed_over_flat", "packed group forward vs one forward per conversation", ">= 1x")),
          ("teacher_tokens_per_s", "train_packed_tokens_per_s", "train_flat_tokens_per_s")),
    Bench("pipeline", "bench.bench_pipeline", (),
          ("--conversations", "4", "--max-a", "8", "--max-q", "8"),
          (("pipeline_over_reference", "self-study conversations/hour: pipeline vs transformers reference", ">= 4x"),),
          ("conversations_per_hour", "reference_conversations_per_hour", "s_per_conversation",
           "synthesis_tokens_per_s", "teacher_tokens_per_s", "train_tokens_per_s")),
    Bench("workers", "bench.bench_workers", (), ("--conversations", "4", "--max-a", "8"),
          (("flow_over_nanny_malloc", "a worker's synthesis shard: as the flow spawns it vs with Dask's "
            "MALLOC_TRIM_THRESHOLD_", ">= 1x"),),
          ("flow_s", "nanny_malloc_s")),
    Bench("fanout", "bench.bench_fanout", (), ("--conversations", "2", "--max-a", "8", "--rounds", "1"),
          (("side_by_side_over_sequential", "synthesis shards side by side in one process, one thread each, vs "
            "one after another on every thread", ">= 1x"),),
          ("sequential_s_per_conversation", "side_by_side_s_per_conversation")),
    Bench("speculation", "bench.bench_spec", (),
          ("--conversations", "4", "--max-a", "12", "--max-new", "12"),
          (("synthesis_spec_over_plain", "bot B drafting 3 tokens per step vs plain (same answers)", "> 1x to be on by default"),
           ("serving_spec_over_plain", "one request at a time: drafting 3 tokens per step vs plain", "> 1x to be on by default")),
          ()),
    Bench("serving", "bench.bench_serve", (),
          ("--max-new", "4", "--concurrency", "2", "--sequential", "1", "--p", "16", "--window", "1024"),
          (("ttft_ratio", "time to first token: document in the prompt vs behind the cartridge", ">= 20x"),
           ("kv_bytes_ratio", "KV bytes per request: document in the prompt vs cartridge", ""),
           ("concurrency_throughput_ratio", "decode tokens/s: 16 concurrent requests vs 1", ">= 4x")),
          ("kv_bytes_icl", "kv_bytes_cartridge")),
)


def run_bench(bench: Bench, quick: bool, log) -> dict:
    """Run one benchmark's module with --json and return its last-line JSON object."""
    cmd = [sys.executable, "-m", bench.module, *(bench.quick if quick else bench.args), "--json"]
    log(f"bench: {bench.name}: {' '.join(cmd[1:])}")
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{bench.module} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    result = json.loads(lines[-1])
    result["wall_s"] = time.perf_counter() - start
    return result


def table_rows(results: dict[str, dict]) -> list[dict]:
    rows = []
    for bench in BENCHES:
        res = results.get(bench.name)
        if res is None:
            continue
        for key, what, goal in bench.ratios:
            rows.append({"benchmark": bench.name, "metric": key, "value": float(res[key]),
                         "compares": what, "goal": goal})
        for key in bench.raw:
            if key in res:
                rows.append({"benchmark": bench.name, "metric": key, "value": float(res[key]),
                             "compares": "raw figure", "goal": ""})
    return rows


def markdown(rows: list[dict], quick: bool) -> str:
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = ["# Benchmarks", "",
             f"Measured {now} by `make bench`{' (quick mode: too small to quote)' if quick else ''} on "
             f"{platform.machine()}, {os.cpu_count()} CPUs, load average {load} at the end. "
             "Each row's two arms ran side by side in the same process.", "",
             "| benchmark | metric | value | compares | goal |", "|---|---|---|---|---|"]
    for r in rows:
        value = f"{r['value']:.2f}x" if r["compares"] != "raw figure" else f"{r['value']:.1f}"
        lines.append(f"| {r['benchmark']} | `{r['metric']}` | {value} | {r['compares']} | {r['goal']} |")
    return "\n".join(lines) + "\n"


KEEP = "<!-- below: notes that make bench keeps -->"


def kept_notes(path: Path) -> str:
    """The measured notes under the KEEP line of an existing file (levers measured one by one)."""
    text = path.read_text() if path.is_file() else ""
    return "\n" + text[text.index(KEEP):] if KEEP in text else ""


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks the command, not the hardware")
    ap.add_argument("--only", action="append", help="run only this benchmark (repeatable)")
    ap.add_argument("--out", default="docs/BENCHMARKS.md", help="markdown table written here")
    ap.add_argument("--store", default=None, help="artifact store root for the benchmarks table")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    chosen = [b for b in BENCHES if not args.only or b.name in args.only]
    results = {b.name: run_bench(b, args.quick, log) for b in chosen}
    rows = table_rows(results)
    text = markdown(rows, args.quick)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + kept_notes(out))
    stamp = datetime.now(UTC).isoformat()

    def work(ctx: StageContext) -> None:
        ctx.write_shard(0, pa.Table.from_pylist([{**r, "measured_at": stamp, "quick": args.quick}
                                                 for r in rows], schema=BENCHMARKS))
        ctx.write_file("results.json", json.dumps(results, indent=1).encode())

    Store(args.store).run("bench", 1, {"at": stamp, "quick": args.quick}, [], work)
    print(text)
    summary = {"rows": rows, "results": results, "out": args.out}
    if args.json:
        print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
