"""Bounded load test of `cartridges serve` on loopback: latency, errors and memory under churn.

Starts the server as its own process (tiny random Llama and a corpus-initialized
cartridge unless `--model`/`--cartridge` are given), warms it up, then sends `--requests`
chat completions from `--clients` concurrent clients: plain and streaming, some streams
abandoned after their first chunk (the client disconnects), plus a share of malformed
bodies that must get 4xx. Every well-formed request that is not abandoned must be answered
200 with a complete body. Records p50/p99 latency, errors, the peak of running streams
(capped by `--max-batch`, the resident KV slots) and the server's resident memory after
warm-up and after the run (the server must be back to idle: no growth from abandoned streams).
Prints a table; `--json` adds one JSON object as the last line.
Run: `python -m bench.load_serve [--requests 200] [--clients 32] [--json]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

QUESTIONS = ["What is in the document?", "Who jumps over the dog?", "Say something short.",
             "Which animal is quick?", "Summarize the text in one line."]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def tiny_assets(directory: Path) -> tuple[Path, Path]:
    """A tiny random Llama directory and a corpus-initialized cartridge for it."""
    from tests.serving import TEXTS, write_cartridge
    from tests.tiny import tiny_llama

    lm = tiny_llama()
    model = directory / "tiny-llama"
    lm.model.save_pretrained(model)
    lm.tokenizer.save_pretrained(model)
    return model, write_cartridge(lm, directory / "fox.safetensors", TEXTS["fox"] * 4, p=64)


def start_server(model: Path, cartridge: Path, max_batch: int, max_tokens: int, log: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-c", "import sys; from cli.main import main; sys.exit(main())", "serve",
           "--model", str(model), "--cartridge", str(cartridge), "--port", "0", "--threads", "1",
           "--max-batch", str(max_batch), "--max-tokens-cap", str(max_tokens), "--name", "fox",
           "--default-max-tokens", str(max_tokens)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [
        str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))}
    out = open(log, "w")  # noqa: SIM115  (kept open for the server's life)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=out, text=True, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"server exited during start-up (exit {proc.wait()}); see {log}")
        if " at http://" in line:
            url = line.split(" at ", 1)[1].split()[0].removesuffix("/v1")
            return proc, url
    proc.kill()
    raise RuntimeError("server did not start within 300 s")


def body(rng: random.Random, stream: bool, max_tokens: int) -> dict:
    return {"model": "fox", "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}],
            "max_tokens": rng.randint(1, max_tokens), "temperature": rng.choice([0, 0.7, 1.0]),
            "seed": rng.randrange(1 << 30), "stream": stream}


MALFORMED = [b"{not json", b'{"model": "fox"}', b'{"model": "fox", "messages": []}',
             b'{"model": "fox", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}',
             b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}']


async def one(client: httpx.AsyncClient, url: str, kind: str, rng: random.Random, max_tokens: int) -> dict:
    started = time.perf_counter()
    try:
        if kind == "malformed":
            resp = await client.post(f"{url}/v1/chat/completions", content=rng.choice(MALFORMED),
                                     headers={"Content-Type": "application/json"})
            ok = 400 <= resp.status_code < 500 and "error" in resp.json()
            return {"kind": kind, "ok": ok, "status": resp.status_code, "seconds": time.perf_counter() - started}
        if kind == "plain":
            resp = await client.post(f"{url}/v1/chat/completions", json=body(rng, False, max_tokens))
            ok = resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] in ("stop", "length")
            return {"kind": kind, "ok": ok, "status": resp.status_code, "seconds": time.perf_counter() - started}
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body(rng, True, max_tokens)) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return {"kind": kind, "ok": False, "status": resp.status_code,
                        "seconds": time.perf_counter() - started}
            done = finished = False
            async for line in resp.aiter_lines():
                if kind == "abandon" and line.startswith("data: "):
                    break  # the client goes away after the first chunk
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: ") and json.loads(line[6:])["choices"]:
                    finished = finished or json.loads(line[6:])["choices"][0]["finish_reason"] is not None
            ok = kind == "abandon" or (done and finished)
            return {"kind": kind, "ok": ok, "status": resp.status_code, "seconds": time.perf_counter() - started}
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return {"kind": kind, "ok": False, "status": None, "error": f"{type(exc).__name__}: {exc}",
                "seconds": time.perf_counter() - started}


async def drive(url: str, kinds: list[str], clients: int, seed: int, max_tokens: int) -> list[dict]:
    rng = random.Random(seed)
    todo = list(enumerate(kinds))
    results: list[dict] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def worker(w: int) -> None:
            local = random.Random(seed * 1000 + w)
            while todo:
                _, kind = todo.pop()
                results.append(await one(client, url, kind, local, max_tokens))

        await asyncio.gather(*(worker(w) for w in range(clients)))
    assert len(results) == len(kinds) and rng
    return results


def wait_idle(url: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{url}/health", timeout=10).json()
        if health["active"] == 0 and health["waiting"] == 0:
            return health
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not idle {timeout} s after the run: {health}")
        time.sleep(0.2)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run(requests: int = 200, clients: int = 32, max_batch: int = 8, max_tokens: int = 16, warmup: int = 32,
        abandon: float = 0.1, malformed: float = 0.05, stream: float = 0.5, seed: int = 0,
        model: Path | None = None, cartridge: Path | None = None) -> dict:
    work = Path(tempfile.mkdtemp(prefix="load-serve-"))
    if model is None or cartridge is None:
        model, cartridge = tiny_assets(work)
    proc, url = start_server(model, cartridge, max_batch, max_tokens, work / "server.log")
    try:
        warm_kinds = ["plain", "stream"] * (warmup // 2)
        asyncio.run(drive(url, warm_kinds, clients, seed + 1, max_tokens))
        wait_idle(url)
        rss_warm = rss_bytes(proc.pid)
        rng = random.Random(seed)
        kinds = []
        for _ in range(requests):
            x = rng.random()
            kinds.append("malformed" if x < malformed else "abandon" if x < malformed + abandon
                         else "stream" if x < malformed + abandon + stream else "plain")
        started = time.perf_counter()
        results = asyncio.run(drive(url, kinds, clients, seed, max_tokens))
        wall = time.perf_counter() - started
        health = wait_idle(url)
        rss_after = rss_bytes(proc.pid)
        alive = proc.poll() is None
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    answered = [r for r in results if r["kind"] in ("plain", "stream")]
    latencies = [r["seconds"] for r in answered if r["ok"]]
    errors = [r for r in results if not r["ok"]]
    return {
        "requests": len(results), "clients": clients, "max_batch": max_batch, "max_tokens": max_tokens,
        "well_formed": len(answered), "answered_ok": len(latencies),
        "abandoned": sum(r["kind"] == "abandon" for r in results),
        "malformed": sum(r["kind"] == "malformed" for r in results),
        "malformed_4xx": sum(r["kind"] == "malformed" and r["ok"] for r in results),
        "errors": len(errors), "error_samples": errors[:5],
        "p50_s": percentile(latencies, 0.5), "p99_s": percentile(latencies, 0.99),
        "mean_s": statistics.fmean(latencies) if latencies else float("nan"), "wall_s": wall,
        "requests_per_s": len(results) / wall,
        "peak_active": health["peak_active"], "served": health["served"], "server_failures": health["failures"],
        "rss_warm_mib": rss_warm / 2**20, "rss_after_mib": rss_after / 2**20,
        "rss_growth": rss_after / rss_warm - 1, "server_alive": alive,
    }


def table(r: dict) -> str:
    rows = [
        ("requests (clients)", f"{r['requests']} ({r['clients']} concurrent)"),
        ("well-formed answered 200", f"{r['answered_ok']} / {r['well_formed']}"),
        ("abandoned streams", r["abandoned"]),
        ("malformed answered 4xx", f"{r['malformed_4xx']} / {r['malformed']}"),
        ("errors", r["errors"]),
        ("latency p50 / p99", f"{r['p50_s'] * 1000:.0f} ms / {r['p99_s'] * 1000:.0f} ms"),
        ("throughput", f"{r['requests_per_s']:.1f} requests/s over {r['wall_s']:.1f} s"),
        ("peak running streams (cap)", f"{r['peak_active']} ({r['max_batch']})"),
        ("server RSS after warm-up / after", f"{r['rss_warm_mib']:.1f} MiB / {r['rss_after_mib']:.1f} MiB "
                                             f"({r['rss_growth'] * 100:+.1f}%)"),
        ("server failures, alive", f"{r['server_failures']}, {r['server_alive']}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=8, help="the server's resident KV slots")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=32)
    parser.add_argument("--abandon", type=float, default=0.1, help="share of streams dropped after one chunk")
    parser.add_argument("--malformed", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--cartridge", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    r = run(args.requests, args.clients, args.max_batch, args.max_tokens, args.warmup, args.abandon,
            args.malformed, seed=args.seed, model=args.model, cartridge=args.cartridge)
    print(table(r))
    if args.json:
        print(json.dumps(r))
    ok = r["errors"] == 0 and r["rss_growth"] <= 0.10 and r["peak_active"] <= r["max_batch"] and r["server_alive"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
