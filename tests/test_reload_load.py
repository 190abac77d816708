"""Reloads under load: a published fleet root gets new versions while 32 clients keep asking.

`cartridges serve --fleet ROOT` (tiny Llama, its own process) answers 32 concurrent clients,
plain and streamed, first turns and follow-ups, while `run_retrain` (smoke preset) edits a
document, retrains it and publishes the next version five times, telling the server to
reload by POST /admin/reload and by SIGHUP in turn. Every answer names the fleet version
that served it (`X-Fleet-Version`); the reference for each answer is greedy `generate`
alone behind that version's own files (a copy taken as it was published), so an answer
that mixed versions (one version's rows or kept KV under another's name) differs from it.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import threading
import time

import httpx
import pytest
import torch

from bench.load_serve import rss_bytes, wait_idle
from bench.soak import send, start_fleet_server, stop_server
from cartridges.core.batch import Stream
from cartridges.core.chat import end_of_turn_ids
from cartridges.core.generate import generate
from cartridges.fleet import Fleet
from jobs.retrain import notify_reload, run_retrain
from schemas.presets import fleet_preset
from server.selector import render_prompt
from storage import Store
from storage.versions import current
from tests.test_fleet_run import quiet
from tests.tiny import tiny_llama

pytestmark = pytest.mark.reliability

CLIENTS = 32
PUBLISHES = 5
MAX_TOKENS = 8
NEAR_TIE = 1e-3  # top-2 logit margin below which a batched float32 step may round the other way
QUESTIONS = ["What is this about?", "Which clock is fast?", "Tell me about the river.",
             "What does the text say about the tower clocks and the bells that ring every hour?",
             "Say one word.", "Where does the water go?", "Explain the passage: the mill turns, the bells ring.",
             "Why?", "Summarize both documents in a long sentence, please, with every detail you can find."]
FOLLOW_UPS = ["And then?", "Tell me more."]


# Each edition of `clocks.md` differs from its first bytes, in kinds of characters too: behind a
# tiny random model that is what it takes for most answers to change with the edition.
EDITIONS = ["AMBER CLOCKS TICK IN THE HALL", "1 2 3 4 5 6 7 8 9 10 11 12 bells", "zzz qqq xxx jjj kkk clocks",
            "?? !! ;; :: -- clocks ring", "\u03a9 clocks \u263c ring \u266b at noon", "tick-tock, tick-tock, TICK-TOCK"]


def write_documents(directory, edition: int) -> None:
    """Two short documents (together fewer chunks than a query scans, so every answer sits behind both)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "river.md").write_text("The river runs past the mill to the sea. " * 5)
    line = EDITIONS[edition] + ". "
    (directory / "clocks.md").write_text(line * max(2, 220 // len(line.encode())))


async def load(url: str, stop: threading.Event, results: list[dict], seed: int) -> None:
    """CLIENTS concurrent clients, greedy, plain or streamed, a quarter with a follow-up turn."""
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def worker(w: int) -> None:
            rng = random.Random(seed * 100 + w)
            while not stop.is_set():
                messages = [{"role": "user", "content": rng.choice(QUESTIONS)}]
                r = await send(client, url, messages, MAX_TOKENS, rng.random() < 0.5, model="f")
                results.append({**r, "messages": messages})
                if r["ok"] and rng.random() < 0.25:
                    messages = [*messages, {"role": "assistant", "content": r["text"]},
                                {"role": "user", "content": rng.choice(FOLLOW_UPS)}]
                    r = await send(client, url, messages, MAX_TOKENS, rng.random() < 0.5, model="f")
                    results.append({**r, "messages": messages})

        await asyncio.gather(*(worker(w) for w in range(CLIENTS)))


class Load:
    """The clients, running in a thread of their own until stopped."""

    def __init__(self, url: str, seed: int) -> None:
        self.results: list[dict] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(load(url, self.stop, self.results, seed)))
        self.thread.start()

    def served_by(self, version: str) -> int:
        return sum(r["fleet_version"] == version for r in list(self.results))

    def finish(self) -> list[dict]:
        self.stop.set()
        self.thread.join(120)
        assert not self.thread.is_alive()
        return self.results


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.1)


class References:
    """What each version answers, alone and greedy, behind the files it was published with."""

    def __init__(self, lm, snapshots) -> None:
        self.lm, self.snapshots = lm, snapshots
        self.eot = tuple(end_of_turn_ids(lm.tokenizer))
        self.fleets: dict[str, Fleet] = {}
        self.memo: dict = {}

    def answer(self, version: str, messages: list[dict]):
        key = (version, json.dumps(messages))
        if key not in self.memo:
            fleet = self.fleets.setdefault(version, Fleet.open(self.snapshots / version, self.lm))
            names = fleet.select(messages[0]["content"], k=fleet.rag_docs)  # the conversation's first question
            gen = generate(self.lm.model, [Stream(render_prompt(self.lm.tokenizer, messages), MAX_TOKENS,
                                                  stop_ids=self.eot)], batch_size=1, prefix_rows=fleet.rows(names))[0]
            self.memo[key] = (names, gen)
        return self.memo[key]

    def text(self, tokens: list[int]) -> str:
        return self.lm.tokenizer.decode([t for t in tokens if t not in self.eot], skip_special_tokens=True)

    def agrees(self, text: str, gen) -> bool:
        """Equal to the reference, or (after a near-tie step) starting with what precedes it."""
        ties = [i for i, m in enumerate(gen.margins) if m < NEAR_TIE]
        if not ties:
            return text == self.text(gen.tokens)
        return text.startswith(self.text(gen.tokens[:ties[0]]).rstrip("\ufffd"))


def test_reloads_under_load_fail_no_request_mix_no_versions_and_return_memory(tmp_path):
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the server's count, so retrieval scores round the same way here
    try:
        run(tmp_path)
    finally:
        torch.set_num_threads(torch_threads)


def run(tmp_path) -> None:
    lm = tiny_llama()
    model = tmp_path / "tiny-llama"
    lm.model.save_pretrained(model)
    lm.tokenizer.save_pretrained(model)
    docs, root, store, snapshots = tmp_path / "docs", tmp_path / "fleet", Store(tmp_path / "s"), tmp_path / "snap"
    cfg = fleet_preset("smoke")

    def snapshot() -> str:
        live = current(root)
        shutil.copytree(live, snapshots / live.name)
        return live.name

    write_documents(docs, 0)
    run_retrain(store, lm, [docs], root, cfg, log=quiet)
    published = [snapshot()]
    proc, url, _ = start_fleet_server(model, root, tmp_path / "server.log", max_batch=8, max_tokens=MAX_TOKENS,
                                   dtype="float32", name="f")
    (tmp_path / "server.pid").write_text(str(proc.pid))

    def health() -> dict:
        return httpx.get(f"{url}/health", timeout=30).json()

    try:
        warm = Load(url, seed=1)
        wait_for(lambda: len(warm.results) >= 300, 120, "300 warm-up answers")
        warm_results = warm.finish()
        wait_idle(url)
        rss_warm = rss_bytes(proc.pid)

        traffic = Load(url, seed=2)
        for cycle in range(1, PUBLISHES + 1):
            wait_for(lambda: traffic.served_by(published[-1]) >= 20, 120, f"answers from {published[-1]}")
            write_documents(docs, cycle)
            via = {"url": url} if cycle % 2 else {"pid_file": tmp_path / "server.pid"}

            def notify(via=via) -> dict:
                published.append(snapshot())
                return notify_reload(**via, log=quiet)

            s = run_retrain(store, lm, [docs], root, cfg, log=quiet, notify=notify)
            assert s["published"] and s["version"] == published[-1] and s["changed"] == ["clocks.md"]
            wait_for(lambda: health()["fleet_version"] == published[-1], 60, f"the server to load {published[-1]}")
        wait_for(lambda: traffic.served_by(published[-1]) >= 20, 120, f"answers from {published[-1]}")
        results = traffic.finish()
        final = wait_idle(url)
        rss_end = rss_bytes(proc.pid)
        alive = proc.poll() is None
    finally:
        stop_server(proc)

    failed = [r["problem"] for r in warm_results + results if not r["ok"]]
    assert not failed, f"{len(failed)} failed requests, e.g. {failed[:3]}"
    assert final["version"] - 1 >= PUBLISHES and final["fleet_version"] == published[-1]  # reloads
    assert alive and final["failures"] == 0

    refs = References(lm, snapshots)
    served: dict[str, int] = {}
    mixed = []
    for r in results:
        version = r["fleet_version"]
        served[version] = served.get(version, 0) + 1
        names, gen = refs.answer(version, r["messages"])
        if r["cartridges"] != names or not refs.agrees(r["text"], gen):
            others = [v for v in published if v != version and refs.agrees(r["text"], refs.answer(v, r["messages"])[1])]
            mixed.append(f"{version} answered {r['text']!r} behind {r['cartridges']} to {r['messages']}; its own "
                         f"files give {refs.text(gen.tokens)!r} behind {names}; matches {others or 'no version'}")
    stale = sum(refs.answer(r["fleet_version"], r["messages"])[1].tokens
                != refs.answer(published[published.index(r["fleet_version"]) - 1], r["messages"])[1].tokens
                for r in results if r["fleet_version"] != published[0])
    print(f"{len(results)} answers under load, per version {served}; {stale} would differ if served by the "
          f"previous version; RSS {rss_warm / 2**20:.1f} MiB after warm-up, {rss_end / 2**20:.1f} MiB after "
          f"{final['version'] - 1} reloads")
    assert not mixed, f"{len(mixed)} answers are not their version's: {mixed[:3]}"
    assert sorted(served) == published and min(served.values()) >= 20  # every version answered under load
    # The versions tell apart: for a third of the questions or more, consecutive versions answer differently.
    differ = [sum(refs.text(refs.answer(a, [{"role": "user", "content": q}])[1].tokens)
                  != refs.text(refs.answer(b, [{"role": "user", "content": q}])[1].tokens) for q in QUESTIONS)
              for a, b in zip(published, published[1:], strict=False)]
    assert min(differ) >= len(QUESTIONS) // 3, differ
    assert rss_end <= 1.05 * rss_warm, f"RSS {rss_warm / 2**20:.1f} -> {rss_end / 2**20:.1f} MiB"
