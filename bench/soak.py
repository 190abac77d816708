"""Soak of `cartridges serve --fleet`: mixed traffic for minutes while new fleet versions are published.

A publisher process builds a fleet root of a few documents with `jobs.retrain.run_retrain`
(smoke preset) and then, every `--publish-every-s` seconds, edits one document, retrains
it and publishes the next version (`versions/NNNN`, `current` switched), telling the
server to reload, by POST /admin/reload and by SIGHUP in turn. The server
(`cartridges serve --fleet ROOT`, its own process) meanwhile gets `--clients` concurrent
clients: fleet questions of varying lengths (a few words to a quoted passage), plain and
streamed, greedy and sampled, some two-turn conversations (the follow-up sits behind the
kept KV), a few streams abandoned after their first chunk, and answer budgets from 1 to
`--max-tokens`. Every response must be a complete 200 naming one fleet version (the
`X-Fleet-Version` header, equal to the `fleet_version` of every chunk); anything else is
an error.

Reports the errors, p50/p99 latency per `--window-s` window (and the last window's p99
against the first's), the reloads, and the server's resident memory over time as a ratio
to its value after `--warmup-s` of the same traffic, beside the KV rows the server keeps
for conversations (bounded by `serve --max-conversation-rows`). `--json` prints one JSON
object as the last line.
Run: `python -m bench.soak [--minutes 30] [--window-s 300] [--model M] [--json]`;
`--model tiny` serves a tiny random Llama (seconds to build; what the test uses).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import queue
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.load_serve import percentile, rss_bytes, wait_idle

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DOCS = ["docs/corpus/deflate.md", "docs/eval/raft.md", "docs/eval/panama.md", "docs/eval/photosynthesis.md"]
GENERIC = ["What is this about?", "Summarize the document.", "Say something short.", "What comes next?"]
FOLLOW_UPS = ["Tell me more.", "Why?", "Can you give an example from the text?", "And after that?"]
SERVED_NAME = "soak"


# --- assets -------------------------------------------------------------------------------
def tiny_model(directory: Path) -> Path:
    """A tiny random Llama saved as a model directory (tests.tiny)."""
    from tests.tiny import tiny_llama

    lm = tiny_llama()
    lm.model.save_pretrained(directory)
    lm.tokenizer.save_pretrained(directory)
    return directory


def base_texts(n: int, chars: int) -> dict[str, str]:
    """The first `chars` characters (whole paragraphs) of `n` documents of this repository."""
    out = {}
    for rel in SOURCE_DOCS[:n]:
        text, kept = (ROOT / rel).read_text(), []
        for para in text.split("\n\n"):
            if kept and sum(len(p) + 2 for p in kept) + len(para) > chars:
                break
            kept.append(para)
        out[Path(rel).name] = "\n\n".join(kept).strip() + "\n"
    return out


def revise(directory: Path, base: dict[str, str], cycle: int) -> str:
    """Edit one document (in turn) for publish `cycle`: its paragraphs rotated and a revision line."""
    names = sorted(base)
    name = names[cycle % len(names)]
    paras = base[name].split("\n\n")
    k = cycle % len(paras)
    (directory / name).write_text(f"Revision {cycle} of {name}.\n\n" + "\n\n".join(paras[k:] + paras[:k]))
    return name


def sentences(texts: dict[str, str]) -> list[str]:
    out = []
    for text in texts.values():
        out += [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if 30 <= len(s.strip()) <= 400]
    return out


def question(rng: random.Random, pool: list[str]) -> str:
    """A fleet question: generic, about a phrase of the documents, or a quoted passage (varying lengths)."""
    x = rng.random()
    if x < 0.2 or not pool:
        return rng.choice(GENERIC)
    if x < 0.7:
        words = rng.choice(pool).split()
        start = rng.randrange(max(1, len(words) - 4))
        return f"What does the text say about {' '.join(words[start:start + rng.randint(2, 5)])}?"
    start = rng.randrange(len(pool))
    return f"Explain this passage: \"{' '.join(pool[start:start + rng.randint(1, 3)])}\""


# --- the server and one request -------------------------------------------------------------
def start_fleet_server(model: Path | str, root: Path, log: Path, max_batch: int = 8, max_tokens: int = 32,
                       threads: int = 1, dtype: str | None = None, name: str = SERVED_NAME,
                       timeout: float = 600) -> tuple[subprocess.Popen, str, str]:
    """`cartridges serve --fleet ROOT` as its own process on a free loopback port: (process, base URL, the
    line it printed when ready: what it serves, on which model, device and dtype)."""
    cmd = [sys.executable, "-c", "import sys; from cli.main import main; sys.exit(main())", "serve",
           "--fleet", str(root), "--model", str(model), "--port", "0", "--threads", str(threads),
           "--max-batch", str(max_batch), "--max-tokens-cap", str(max_tokens),
           "--default-max-tokens", str(max_tokens), "--name", name, *(["--dtype", dtype] if dtype else [])]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = open(log, "w")  # noqa: SIM115  (kept open for the server's life)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=out, text=True, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"server exited during start-up (exit {proc.wait()}); see {log}")
        if " at http://" in line:
            return proc, line.split(" at ", 1)[1].split()[0].removesuffix("/v1"), line.strip()
    proc.kill()
    raise RuntimeError(f"server did not start within {timeout:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def send(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int, stream: bool,
               temperature: float = 0.0, seed: int | None = None, abandon: bool = False,
               model: str = SERVED_NAME) -> dict:
    """One chat completion, checked: a complete 200 that names one fleet version throughout.

    Returns the outcome: `ok`, `problem` (why not), `seconds`, `text`, `finish_reason`,
    `fleet_version` and `cartridges` (the documents behind the answer).
    """
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
            "stream": stream, **({"seed": seed} if seed is not None else {})}
    out: dict = {"stream": stream, "abandoned": abandon, "ok": False, "problem": None, "status": None,
                 "text": None, "finish_reason": None, "fleet_version": None, "cartridges": None}
    started = time.perf_counter()
    try:
        if not stream:
            resp = await client.post(f"{url}/v1/chat/completions", json=body)
            out["status"] = resp.status_code
            if resp.status_code != 200:
                out["problem"] = f"status {resp.status_code}: {resp.text[:200]}"
            else:
                data = resp.json()
                choice = data["choices"][0]
                out.update(text=choice["message"]["content"], finish_reason=choice["finish_reason"],
                           fleet_version=resp.headers.get("x-fleet-version"), cartridges=data.get("cartridges"))
                out["problem"] = _version_problem(out["fleet_version"], {data.get("fleet_version")}) or (
                    None if out["finish_reason"] in ("stop", "length") else f"finish_reason {out['finish_reason']}")
        else:
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
                out["status"] = resp.status_code
                if resp.status_code != 200:
                    out["problem"] = f"status {resp.status_code}: {(await resp.aread())[:200]!r}"
                else:
                    out["fleet_version"] = resp.headers.get("x-fleet-version")
                    seen, parts, done = set(), [], False
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            break
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            out["problem"] = f"error in stream: {chunk['error']}"
                            break
                        seen.add(chunk.get("fleet_version"))
                        out["cartridges"] = chunk.get("cartridges")
                        if chunk["choices"]:
                            parts.append(chunk["choices"][0]["delta"].get("content") or "")
                            out["finish_reason"] = chunk["choices"][0]["finish_reason"] or out["finish_reason"]
                        if abandon:
                            break  # the client goes away after the first chunk
                    out["text"] = "".join(parts)
                    if out["problem"] is None:
                        out["problem"] = _version_problem(out["fleet_version"], seen) or (
                            None if abandon or (done and out["finish_reason"] in ("stop", "length"))
                            else f"incomplete stream (done={done}, finish_reason={out['finish_reason']})")
        out["ok"] = out["problem"] is None
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        out["problem"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = time.perf_counter() - started
    return out


def _version_problem(header: str | None, in_body: set) -> str | None:
    if not header:
        return "no X-Fleet-Version header"
    if in_body != {header}:
        return f"X-Fleet-Version {header} but the body names {sorted(map(str, in_body))}"
    return None


# --- the publisher ----------------------------------------------------------------------------
def publisher(model: str, dtype: str | None, docs: str, root: str, store: str, base: dict, interval: float,
              events, stop, url_box, pid_box) -> None:
    """In its own process: build version 0001, then edit, retrain and publish one version every `interval` s."""
    def quiet(_line: str) -> None:
        pass

    try:
        import torch

        from cartridges.core.models import load_model
        from jobs.retrain import notify_reload, run_retrain
        from schemas.presets import fleet_preset
        from storage import Store

        torch.set_num_threads(1)
        lm = load_model(model, None, dtype)
        cfg, st = fleet_preset("smoke"), Store(store)
        s = run_retrain(st, lm, [docs], root, cfg, log=quiet)
        events.put({"version": s["version"], "seconds": s["seconds"], "via": None, "edited": None})
        url = url_box.get()
        pid_file = Path(root).parent / "server.pid"
        pid_file.write_text(str(pid_box.get()))
        cycle = 0
        while not stop.wait(interval):
            cycle += 1
            edited = revise(Path(docs), base, cycle)
            via = "http" if cycle % 2 else "sighup"

            def notify(via=via):
                return notify_reload(url=url, log=quiet) if via == "http" else notify_reload(pid_file=pid_file, log=quiet)

            s = run_retrain(st, lm, [docs], root, cfg, log=quiet, notify=notify)
            events.put({"version": s["version"], "seconds": s["seconds"], "via": via, "edited": edited,
                        "published": s["published"], "t": time.time()})
    except BaseException as exc:  # reported to the soak, which counts it as an error
        events.put({"error": f"{type(exc).__name__}: {exc}"})


# --- the soak ------------------------------------------------------------------------------
async def traffic(url: str, clients: int, until: float, pool: list[str], max_tokens: int, seed: int,
                  results: list[dict], started: float, abandon: float = 0.05, conversation: float = 0.2,
                  stream: float = 0.4) -> None:
    """`clients` concurrent clients sending the mix until `until` (monotonic); outcomes go to `results`."""
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def worker(w: int) -> None:
            rng = random.Random(seed * 1000 + w)
            while time.monotonic() < until:
                x = rng.random()
                kind = ("abandon" if x < abandon else "conversation" if x < abandon + conversation
                        else "stream" if x < abandon + conversation + stream else "plain")
                messages = [{"role": "user", "content": question(rng, pool)}]
                temperature = rng.choice([0.0, 0.0, 0.7])
                t0 = time.monotonic() - started
                r = await send(client, url, messages, rng.randint(1, max_tokens), kind in ("stream", "abandon"),
                               temperature, rng.randrange(1 << 30), abandon=kind == "abandon")
                results.append({**r, "kind": kind, "t": t0})
                if kind == "conversation" and r["ok"] and time.monotonic() < until:
                    messages += [{"role": "assistant", "content": r["text"]},
                                 {"role": "user", "content": rng.choice(FOLLOW_UPS)}]
                    t1 = time.monotonic() - started
                    r = await send(client, url, messages, rng.randint(1, max_tokens), rng.random() < 0.5,
                                   temperature, rng.randrange(1 << 30))
                    results.append({**r, "kind": "follow-up", "t": t1})

        await asyncio.gather(*(worker(w) for w in range(clients)))


def next_event(events, pub, timeout: float = 3600) -> dict | None:
    """The publisher's next report; None when there is none within `timeout` s or the process is gone."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return events.get(timeout=1)
        except queue.Empty:
            if not pub.is_alive() or time.monotonic() >= deadline:
                return None


async def sample_rss(pid: int, url: str, until: float, every: float, started: float, samples: list) -> None:
    """(seconds, RSS bytes, KV rows the server keeps for conversations) every `every` s until `until`."""
    async with httpx.AsyncClient(timeout=60) as client:
        while time.monotonic() < until:
            rows = (await client.get(f"{url}/health")).json().get("conversation_rows")
            samples.append((time.monotonic() - started, rss_bytes(pid), rows))
            await asyncio.sleep(every)


def cpu_model() -> str:
    """lscpu's model name and the CPUs this process may use."""
    name = "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        name = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name:")),
                    name)
    except (OSError, subprocess.SubprocessError):
        pass
    return f"{name}, {len(os.sched_getaffinity(0))} CPUs"


def run(minutes: float = 30.0, window_s: float = 300.0, model: str | None = None, dtype: str | None = None,
        clients: int = 16, publish_every_s: float = 120.0, max_batch: int = 8, max_tokens: int = 32,
        docs: int = 3, doc_chars: int = 1500, warmup_s: float = 60.0, sample_s: float = 5.0, seed: int = 0,
        threads: int = 1, work: Path | None = None) -> dict:
    work = Path(work or tempfile.mkdtemp(prefix="soak-"))
    work.mkdir(parents=True, exist_ok=True)
    model = str(tiny_model(work / "tiny-llama")) if model == "tiny" else (model or "default")
    base = base_texts(docs, doc_chars)
    doc_dir, root = work / "docs", work / "fleet"
    shutil.rmtree(doc_dir, ignore_errors=True)
    doc_dir.mkdir()
    for name, text in base.items():
        (doc_dir / name).write_text(text)
    pool = sentences(base)

    ctx = multiprocessing.get_context("spawn")
    events, url_box, pid_box, stop = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
    pub = ctx.Process(target=publisher, args=(model, dtype, str(doc_dir), str(root), str(work / "store"), base,
                                              publish_every_s, events, stop, url_box, pid_box), daemon=True)
    pub.start()
    publishes, errors_outside = [], []
    first = next_event(events, pub)
    if first is None or "error" in first:
        pub.join(30)
        raise RuntimeError(f"building the first fleet version failed: {(first or {}).get('error', 'no report')}")
    publishes.append({**first, "t_s": 0.0})
    proc, url, banner = start_fleet_server(model, root, work / "server.log", max_batch, max_tokens, threads, dtype)
    results: list[dict] = []
    rss: list[tuple[float, int, int | None]] = []
    try:
        warm: list[dict] = []  # the same mix for `warmup_s` on version 0001: RSS settles before it is the base
        asyncio.run(traffic(url, clients, time.monotonic() + warmup_s, pool, max_tokens, seed + 1, warm,
                            time.monotonic()))
        wait_idle(url, timeout=600)
        rss_warm = rss_bytes(proc.pid)
        url_box.put(url)
        pid_box.put(proc.pid)
        started = time.monotonic()
        t0_wall = time.time()
        until = started + minutes * 60

        async def soak() -> None:
            await asyncio.gather(traffic(url, clients, until, pool, max_tokens, seed, results, started),
                                 sample_rss(proc.pid, url, until, sample_s, started, rss))

        asyncio.run(soak())
        elapsed = time.monotonic() - started
        stop.set()
        pub.join(1800)
        while (e := next_event(events, pub, timeout=0)) is not None:
            if "error" in e:
                errors_outside.append(f"publisher: {e['error']}")
            else:
                publishes.append({**e, "t_s": round(e.get("t", t0_wall) - t0_wall, 1)})
        last = publishes[-1]["version"]
        deadline = time.monotonic() + 120
        while (health := httpx.get(f"{url}/health", timeout=30).json())["fleet_version"] != last:
            if time.monotonic() > deadline:
                errors_outside.append(f"server still serves {health['fleet_version']}, not the last published {last}")
                break
            time.sleep(0.5)
        health = wait_idle(url, timeout=600)
        rss_end = rss_bytes(proc.pid)
        rss.append((time.monotonic() - started, rss_end, health.get("conversation_rows")))
        alive = proc.poll() is None
    finally:
        stop.set()
        if pub.is_alive():
            pub.terminate()
        stop_server(proc)
    return report(results, warm, rss, rss_warm, rss_end, publishes, errors_outside, health, alive, elapsed,
                  minutes * 60, window_s, model=model, server=banner, clients=clients, max_batch=max_batch, max_tokens=max_tokens,
                  publish_every_s=publish_every_s, documents=sorted(base), threads=threads)


def report(results: list[dict], warm: list[dict], rss: list, rss_warm: int, rss_end: int, publishes: list,
           errors_outside: list, health: dict, alive: bool, elapsed: float, duration: float, window_s: float,
           **setup) -> dict:
    """The figures: overall, per window of `window_s` over the `duration` s of traffic, and RSS over time."""
    failed = [r for r in results if not r["ok"]]
    counted = [r for r in results if r["ok"] and not r["abandoned"]]
    windows = []
    for k in range(max(1, int(-(-duration // window_s)))):
        lo, hi = k * window_s, min((k + 1) * window_s, duration)
        inside = [r for r in results if lo <= r["t"] < hi]
        lat = [r["seconds"] for r in inside if r["ok"] and not r["abandoned"]]
        ratios = [b / rss_warm for t, b, _ in rss if lo <= t < hi or (hi == duration and t >= hi)]
        windows.append({
            "start_s": round(lo, 1), "end_s": round(hi, 1), "requests": len(inside),
            "errors": sum(not r["ok"] for r in inside),
            "p50_ms": 1000 * percentile(lat, 0.5), "p99_ms": 1000 * percentile(lat, 0.99),
            "reloads": sum(1 for p in publishes[1:] if lo <= p["t_s"] < hi),
            "rss_ratio_end": ratios[-1] if ratios else None, "rss_ratio_max": max(ratios) if ratios else None,
        })
    lat = [r["seconds"] for r in counted]
    served: dict[str, int] = {}
    for r in results:
        if r["fleet_version"]:
            served[r["fleet_version"]] = served.get(r["fleet_version"], 0) + 1
    kinds: dict[str, int] = {}
    for r in results:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    full = [w for w in windows if w["end_s"] - w["start_s"] >= 0.999 * window_s] or windows
    return {
        **setup, "cpu": cpu_model(), "minutes": elapsed / 60, "window_s": window_s,
        "requests": len(results), "kinds": kinds, "abandoned": sum(r["abandoned"] for r in results),
        "errors": len(failed) + len(errors_outside) + sum(not r["ok"] for r in warm),
        "error_samples": [r["problem"] for r in failed[:5]] + errors_outside,
        "warmup_errors": sum(not r["ok"] for r in warm),
        "p50_ms": 1000 * percentile(lat, 0.5), "p99_ms": 1000 * percentile(lat, 0.99),
        "mean_ms": 1000 * statistics.fmean(lat) if lat else float("nan"),
        "p99_drift": full[-1]["p99_ms"] / full[0]["p99_ms"] if full[0]["p99_ms"] else float("nan"),
        "windows": windows,
        "publishes": publishes, "published": len(publishes) - 1,
        "reloads": health["version"] - 1, "fleet_version_end": health["fleet_version"],
        "fleet_versions_served": served,
        "rss_warm_mib": rss_warm / 2**20, "rss_end_mib": rss_end / 2**20, "rss_ratio_end": rss_end / rss_warm,
        "rss_ratio_max": max(b for _, b, _ in rss) / rss_warm,
        "rss": [[round(t, 1), round(b / rss_warm, 4), rows] for t, b, rows in rss],
        "max_conversation_rows_kept": max((rows or 0 for _, _, rows in rss), default=0),
        "peak_active": health["peak_active"], "served": health["served"], "server_failures": health["failures"],
        "server_alive": alive,
    }


def table(r: dict) -> str:
    lines = [f"soak: {r['minutes']:.1f} min on {r['model']} ({r['cpu']}), {r['clients']} clients, "
             f"max batch {r['max_batch']}, a version published {r['publish_every_s']:.0f} s after the last",
             f"server: {r['server']}",
             f"requests {r['requests']} ({', '.join(f'{k} {v}' for k, v in sorted(r['kinds'].items()))}); "
             f"errors {r['errors']}" + (f": {r['error_samples']}" if r["errors"] else ""),
             f"published {r['published']} versions, server reloads {r['reloads']}, now serving "
             f"{r['fleet_version_end']}; answers per version {r['fleet_versions_served']}",
             f"latency p50 {r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms; p99 last/first window {r['p99_drift']:.2f}",
             f"RSS after warm-up {r['rss_warm_mib']:.1f} MiB; at the end {r['rss_ratio_end']:.3f}x, "
             f"max {r['rss_ratio_max']:.3f}x (conversation KV kept: at most {r['max_conversation_rows_kept']} rows); "
             f"server failures {r['server_failures']}, alive {r['server_alive']}",
             "", f"{'window':>13}  {'requests':>8}  {'errors':>6}  {'p50 ms':>7}  {'p99 ms':>7}  {'reloads':>7}  "
                 f"{'RSS end':>7}  {'RSS max':>7}"]
    for w in r["windows"]:
        lines.append(f"{w['start_s']:>6.0f}-{w['end_s']:<6.0f}  {w['requests']:>8}  {w['errors']:>6}  "
                     f"{w['p50_ms']:>7.0f}  {w['p99_ms']:>7.0f}  {w['reloads']:>7}  {_ratio(w['rss_ratio_end']):>7}  "
                     f"{_ratio(w['rss_ratio_max']):>7}")
    return "\n".join(lines)


def _ratio(x: float | None) -> str:
    return f"{x:.3f}" if x is not None else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--window-s", type=float, default=300.0, help="latency window length")
    parser.add_argument("--model", default=None, help="the default model unless given; 'tiny': a tiny random Llama")
    parser.add_argument("--dtype", default=None, choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--publish-every-s", type=float, default=120.0, help="seconds between publishes")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32, help="answer budgets are drawn from 1..this")
    parser.add_argument("--docs", type=int, default=3, choices=range(1, len(SOURCE_DOCS) + 1))
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    parser.add_argument("--warmup-s", type=float, default=60.0, help="traffic before the RSS base is taken")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=None, help="directory for the fleet, store and logs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    r = run(args.minutes, args.window_s, args.model, args.dtype, args.clients, args.publish_every_s, args.max_batch,
            args.max_tokens, args.docs, warmup_s=args.warmup_s, seed=args.seed, threads=args.threads, work=args.work)
    print(table(r))
    if args.json:
        print(json.dumps(r))
    return 0 if r["errors"] == 0 and r["server_alive"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
