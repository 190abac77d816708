"""The decode loop without HTTP: requests behind different prefixes share steps; the selector seam."""

from __future__ import annotations

import queue
import time

import pytest
import torch

from cartridges.core.batch import Stream
from cartridges.core.generate import generate
from cartridges.core.prefix import capture_rows
from server.engine import Accepted, Engine
from server.errors import ApiError
from server.options import ServeConfig
from server.schema import ChatParams
from server.selector import Selection, render_prompt
from tests.tiny import tiny_llama


class TopicSelector:
    """A stand-in for retrieval: the first user message names the prefix, as fleet mode will."""

    model_id = "topics"

    def __init__(self, lm, topics: dict[str, list[int]]) -> None:
        self.lm = lm
        self.rows = {name: capture_rows(lm.model, torch.tensor(ids)) for name, ids in topics.items()}
        self.finished: list[tuple[str, int, int, list[int]]] = []

    def select(self, messages):
        topic = messages[0]["content"].split()[0]
        if topic not in self.rows:
            raise ApiError(400, f"no topic {topic}")

        prompt = render_prompt(self.lm.tokenizer, messages)

        def keep(kv, tokens, topic=topic, prompt=prompt):
            self.finished.append((topic, len(prompt), kv[0][0].shape[1], tokens))

        return Selection(self.rows[topic], prompt, (topic,), on_finish=keep)

    def reload(self):
        return {}

    def describe(self):
        return {"mode": "test"}


def params(content: str, max_tokens: int) -> ChatParams:
    return ChatParams("topics", [{"role": "user", "content": content}], max_tokens, 0.0, 1.0, None, (), False, False)


def collect(engine: Engine, content: str, max_tokens: int):
    events: queue.Queue = queue.Queue()
    engine.submit(params(content, max_tokens), lambda kind, data: events.put((kind, data)))
    return events


def drain(events: queue.Queue) -> tuple[Accepted | ApiError, list[int]]:
    kind, first = events.get(timeout=30)
    tokens = []
    while kind != "error":
        kind, data = events.get(timeout=30)
        if kind == "token":
            tokens.append(data)
        elif kind in ("done", "error"):
            break
    return first, tokens


@pytest.fixture(scope="module")
def lm():
    return tiny_llama(torch.float64)


def test_requests_behind_different_prefixes_share_steps_and_each_equals_alone(lm):
    gen = torch.Generator().manual_seed(0)
    topics = {name: torch.randint(0, 256, (n,), generator=gen).tolist() for name, n in (("a", 5), ("b", 13), ("c", 1))}
    selector = TopicSelector(lm, topics)
    engine = Engine(lm, selector, ServeConfig(max_batch=4)).start()
    try:
        asks = [(f"{'abc'[i % 3]} question {i}" + "!" * i, 6 + i % 5) for i in range(10)]
        pending = []
        for i, (content, n) in enumerate(asks):
            pending.append(collect(engine, content, n))
            if i % 3 == 2:
                time.sleep(0.01)  # arrive while others decode
        results = [drain(events) for events in pending]
        assert engine.stats()["peak_active"] == 4  # capped at max_batch, the rest waited
    finally:
        engine.stop()
    for (content, n), (accepted, tokens) in zip(asks, results, strict=True):
        assert isinstance(accepted, Accepted) and accepted.names == (content[0],)
        alone = generate(lm.model, [Stream(render_prompt(lm.tokenizer, [{"role": "user", "content": content}]), n,
                                           stop_ids=engine.eot)], prefix_rows=selector.rows[content[0]])[0]
        assert tokens == alone.tokens
    # Every finished stream handed its rows back: prefix + prompt + tokens fed.
    assert len(selector.finished) == len(asks)
    for topic, prompt, rows, tokens in selector.finished:
        assert rows == len(topics[topic]) + prompt + len(tokens) - 1


def test_selector_errors_reach_the_request_and_the_loop_goes_on(lm):
    engine = Engine(lm, TopicSelector(lm, {"a": [1, 2, 3]}), ServeConfig()).start()
    try:
        error, _ = drain(collect(engine, "zzz unknown topic", 4))
        assert isinstance(error, ApiError) and error.status == 400
        accepted, tokens = drain(collect(engine, "a fine", 4))
        assert isinstance(accepted, Accepted) and len(tokens) == 4
    finally:
        engine.stop()


def test_a_full_queue_is_refused_with_429(lm):
    engine = Engine(lm, TopicSelector(lm, {"a": [1]}), ServeConfig(max_batch=1, max_queue=2))  # not started
    for _ in range(2):
        engine.submit(params("a x", 2), lambda *_: None)
    with pytest.raises(ApiError) as err:
        engine.submit(params("a x", 2), lambda *_: None)
    assert err.value.status == 429 and err.value.code == "queue_full"


def test_cancelled_requests_leave_the_batch(lm):
    engine = Engine(lm, TopicSelector(lm, {"a": [1, 2]}), ServeConfig()).start()
    try:
        events: queue.Queue = queue.Queue()
        job = engine.submit(params("a long one", 1500), lambda kind, data: events.put((kind, data)))
        assert events.get(timeout=30)[0] == "accepted"
        assert events.get(timeout=30)[0] == "token"
        engine.cancel(job)
        deadline = time.time() + 10
        while engine.stats()["active"] and time.time() < deadline:
            time.sleep(0.01)
        assert engine.stats()["active"] == 0 and engine.stats()["served"] == 0
    finally:
        engine.stop()


class ReferenceSelector(TopicSelector):
    """Selections that carry a draft reference (a cartridge file's embedded corpus)."""

    def select(self, messages):
        sel = super().select(messages)
        topic = messages[0]["content"].split()[0]
        return Selection(sel.rows, sel.prompt, sel.names, on_finish=sel.on_finish,
                         draft_reference=tuple(self.topics[topic] * 3))


def test_speculative_serving_streams_the_tokens_of_plain_serving(lm):
    gen = torch.Generator().manual_seed(1)
    topics = {name: torch.randint(0, 256, (n,), generator=gen).tolist() for name, n in (("a", 9), ("b", 17))}
    asks = [(f"{'ab'[i % 2]} question {i}" + "?" * i, 20 + 3 * i) for i in range(5)]
    outputs = []
    for spec in (0, 3):
        selector = ReferenceSelector(lm, topics)
        selector.topics = topics
        engine = Engine(lm, selector, ServeConfig(max_batch=3, spec=spec)).start()
        try:
            pending = [collect(engine, content, n) for content, n in asks]
            outputs.append([drain(events)[1] for events in pending])
            drafted = sum(1 for _ in selector.finished)
            stats = engine.stats()
        finally:
            engine.stop()
        # kept rows still count prefix + prompt + tokens fed: rejected drafts are not among them
        for topic, prompt, rows, tokens in selector.finished:
            assert rows == len(topics[topic]) + prompt + len(tokens) - 1
        assert drafted == len(asks)
        assert (stats["accepted_draft_tokens"] > 0) == (spec > 0)  # the drafted path really ran
    assert outputs[0] == outputs[1]
    assert all(len(tokens) == n for tokens, (_, n) in zip(outputs[1], asks, strict=True))
