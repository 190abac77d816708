"""Fleet mode of the server on a tiny fleet: retrieval per conversation, kept KV, adaptive switches, reload."""

from __future__ import annotations

import queue
import shutil

import httpx
import openai
import pytest
import torch

from cartridges.core.batch import Stream
from cartridges.core.errors import FleetError
from cartridges.core.generate import generate
from cartridges.fleet import Fleet
from cli.main import main as cli_main
from jobs.fleet import run_fleet
from schemas.presets import fleet_preset
from server.engine import Accepted, Engine
from server.fleet_selector import (
    Conversation,
    Conversations,
    FleetSelector,
    identity,
    switches,
)
from server.main import Server
from server.options import ServeConfig
from server.schema import ChatParams
from server.selector import render_prompt
from storage import Store
from tests.test_fleet_run import quiet, write_docs
from tests.tiny import tiny_llama

CHUNK = 64  # the smoke preset's embed_chunk: a query equal to a chunk retrieves its document


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A three-document fleet (corpus-initialized cartridges, p=16, and its index), built on the float32 model."""
    root = tmp_path_factory.mktemp("fleet")
    docs = write_docs(root / "docs")
    run_fleet(Store(root / "s"), tiny_llama(), [docs], root / "f", fleet_preset("smoke", {"rounds": 0, "heldout": 0}),
              log=quiet)
    return root


@pytest.fixture(scope="module")
def lm():
    """The same weights in float64 (same fingerprint), so kept KV and a fresh prefill agree to rounding."""
    return tiny_llama(torch.float64)


@pytest.fixture(scope="module")
def ref(built, lm):
    """An independent reader of the same fleet: what the server should select and sit behind."""
    return Fleet.open(built / "f", lm)


def chunk_of(lm, built, name: str, i: int = 1) -> str:
    ids = lm.tokenizer((built / "docs" / name).read_text(), add_special_tokens=False)["input_ids"]
    return lm.tokenizer.decode(ids[i * CHUNK:(i + 1) * CHUNK])


def params(messages: list[dict], max_tokens: int) -> ChatParams:
    return ChatParams("f", messages, max_tokens, 0.0, 1.0, None, (), False, False)


def ask(engine: Engine, messages: list[dict], max_tokens: int = 8) -> tuple[Accepted, list[int]]:
    events: queue.Queue = queue.Queue()
    engine.submit(params(messages, max_tokens), lambda kind, data: events.put((kind, data)))
    kind, accepted = events.get(timeout=60)
    assert kind == "accepted", accepted
    tokens = []
    while True:
        kind, data = events.get(timeout=60)
        if kind == "token":
            tokens.append(data)
        elif kind == "done":
            return accepted, tokens
        else:
            raise AssertionError(data)


def full_prompt_answer(lm, eot, rows, messages, max_tokens=8):
    """The reference: the whole conversation prefilled behind the composed cartridges, no kept KV."""
    return generate(lm.model, [Stream(render_prompt(lm.tokenizer, messages), max_tokens, stop_ids=eot)],
                    prefix_rows=rows)[0]


def text(lm, eot, tokens):
    return lm.tokenizer.decode([t for t in tokens if t not in eot], skip_special_tokens=True)


def follow_up(lm, eot, messages, tokens, question="And what comes next?"):
    return [*messages, {"role": "assistant", "content": text(lm, eot, tokens)}, {"role": "user", "content": question}]


def kept_ids(lm, messages, tokens):
    """Tokens a finished turn's KV holds after the cartridges: its prompt and every answer token fed."""
    return render_prompt(lm.tokenizer, messages) + tokens[:-1]


def reusable(lm, messages, kept) -> int:
    """Leading prompt tokens equal to kept ones (at least one token is left to prefill)."""
    prompt = render_prompt(lm.tokenizer, messages)
    same = [a == b for a, b in zip(prompt, kept, strict=False)] + [False]
    return min(same.index(False), len(prompt) - 1)


@pytest.fixture
def engine_of(lm, built):
    started = []

    def make(**kwargs) -> tuple[FleetSelector, Engine]:
        selector = FleetSelector(lm, built / "f", **kwargs)
        engine = Engine(lm, selector, ServeConfig(max_batch=4)).start()
        started.append(engine)
        return selector, engine

    yield make
    for engine in started:
        engine.stop()


def test_a_follow_up_sits_behind_its_kept_kv_and_answers_like_the_full_prompt(lm, built, ref, engine_of):
    selector, engine = engine_of()
    q1 = chunk_of(lm, built, "d1.md")
    turn1 = [{"role": "user", "content": q1}]
    first, tokens1 = ask(engine, turn1)
    names = tuple(ref.select(q1, k=ref.rag_docs))
    assert len(names) == 2 and first.names == names and first.cached_tokens == 0
    assert first.cartridge_rows == 2 * 16
    assert tokens1 == full_prompt_answer(lm, engine.eot, ref.rows(list(names)), turn1).tokens

    turn2 = follow_up(lm, engine.eot, turn1, tokens1)
    kept = kept_ids(lm, turn1, tokens1)
    cached = reusable(lm, turn2, kept)
    # At least the whole first prompt; the answer as far as the client's copy retokenizes to the same ids
    # (this random model's answers start with a stray UTF-8 continuation byte, so not beyond the prompt).
    assert cached >= len(render_prompt(lm.tokenizer, turn1))
    # The rows the follow-up gets: the kept KV, then only the new tokens; same logits as the full prompt.
    sel = selector.select(turn2)
    assert sel.names == names and sel.cached_tokens == cached and sel.cartridge_rows == 32
    assert sel.prompt == render_prompt(lm.tokenizer, turn2)[cached:]
    behind_kept = generate(lm.model, [Stream(sel.prompt, 8, stop_ids=engine.eot)], prefix_rows=sel.rows)[0]
    full = full_prompt_answer(lm, engine.eot, ref.rows(list(names)), turn2)
    assert behind_kept.tokens == full.tokens
    assert behind_kept.margins == pytest.approx(full.margins, abs=1e-9)
    # ...and the rows matter: the same prompt without the cartridges reads differently.
    bare = generate(lm.model, [Stream(render_prompt(lm.tokenizer, turn2), 8)])[0]
    assert max(abs(a - b) for a, b in zip(full.margins, bare.margins, strict=True)) > 1e-6

    second, tokens2 = ask(engine, turn2)
    assert second.names == names and second.cached_tokens == cached
    assert second.prompt_tokens == len(render_prompt(lm.tokenizer, turn2)) and second.cartridge_rows == 32
    assert tokens2 == full.tokens

    # A third turn reuses the second's KV (which itself sat behind the first's).
    turn3 = follow_up(lm, engine.eot, turn2, tokens2, "Why?")
    third, tokens3 = ask(engine, turn3)
    assert third.cached_tokens == reusable(lm, turn3, kept_ids(lm, turn2, tokens2)) > len(kept)
    assert tokens3 == full_prompt_answer(lm, engine.eot, ref.rows(list(names)), turn3).tokens

    # A one-token answer keeps exactly its prompt's KV, which the next prompt extends: all of it is reused.
    turn4 = follow_up(lm, engine.eot, turn3, tokens3, "Short?")
    _, tokens4 = ask(engine, turn4, max_tokens=1)
    turn5 = follow_up(lm, engine.eot, turn4, tokens4, "Go on.")
    fifth, tokens5 = ask(engine, turn5)
    assert fifth.cached_tokens == len(render_prompt(lm.tokenizer, turn4)) == len(kept_ids(lm, turn4, tokens4))
    assert tokens5 == full_prompt_answer(lm, engine.eot, ref.rows(list(names)), turn5).tokens

    # An edited history (another second answer) reuses the KV only up to the edit.
    kept5 = kept_ids(lm, turn5, tokens5)
    edited = [*turn2, {"role": "assistant", "content": "something else"}, {"role": "user", "content": "And?"}]
    redo, tokens = ask(engine, edited)
    assert redo.names == names and redo.cached_tokens == reusable(lm, edited, kept5)
    assert len(render_prompt(lm.tokenizer, turn2)) <= redo.cached_tokens < len(render_prompt(lm.tokenizer, turn3))
    assert tokens == full_prompt_answer(lm, engine.eot, ref.rows(list(names)), edited).tokens
    # Asking the first turn again reuses its whole prompt but the last token (the logits come from it).
    again, tokens = ask(engine, turn1)
    assert again.cached_tokens == len(render_prompt(lm.tokenizer, turn1)) - 1 and tokens == tokens1
    # Another first message is another conversation: nothing is reused.
    edited_first = [{"role": "user", "content": q1 + " (edited)"}, *turn2[1:]]
    fresh, tokens = ask(engine, edited_first)
    assert fresh.cached_tokens == 0
    assert tokens == full_prompt_answer(lm, engine.eot, ref.rows(list(fresh.names)), edited_first).tokens

    # A new conversation retrieves again, with its own first message.
    q2 = chunk_of(lm, built, "d2.md")
    other, _ = ask(engine, [{"role": "user", "content": q2}])
    assert other.names == tuple(ref.select(q2, k=ref.rag_docs)) and other.names[0] == "d2.md"
    assert other.names != names and other.cached_tokens == 0
    # The system turn is part of a conversation's identity.
    assert identity([{"role": "system", "content": "s"}, *turn1]) != identity(turn1)
    assert identity(turn1) == identity(turn2)


def test_rag_docs_overrides_the_fleet_default(lm, built, ref, engine_of):
    _, engine = engine_of(rag_docs=1)
    q = chunk_of(lm, built, "d0.md")
    accepted, _ = ask(engine, [{"role": "user", "content": q}])
    assert accepted.names == ("d0.md",) == tuple(ref.select(q, k=1)) and accepted.cartridge_rows == 16


@pytest.mark.parametrize("decisive", [True, False])
def test_adaptive_switches_only_on_a_decisive_margin(lm, built, ref, engine_of, decisive):
    q0, q2 = chunk_of(lm, built, "d0.md"), chunk_of(lm, built, "d2.md")
    scores = dict(ref.search(q2, k=3, chunks=100))
    gap = scores["d2.md"] - scores["d0.md"]  # how far the follow-up's own document beats the selected one
    assert gap > 0.5
    margin = gap / 2 if decisive else gap + 0.01
    selector, engine = engine_of(rag_docs=1, adaptive=True, margin=margin)
    turn1 = [{"role": "user", "content": q0}]
    first, tokens1 = ask(engine, turn1)
    assert first.names == ("d0.md",)
    turn2 = follow_up(lm, engine.eot, turn1, tokens1, q2)
    second, tokens2 = ask(engine, turn2)
    if decisive:
        assert second.names == ("d2.md",) and second.cached_tokens == 0 and selector.switches == 1
        rows = ref.rows(["d2.md"])
    else:
        assert second.names == ("d0.md",) and second.cached_tokens == reusable(lm, turn2, kept_ids(lm, turn1, tokens1))
        assert selector.switches == 0
        rows = ref.rows(["d0.md"])
    assert tokens2 == full_prompt_answer(lm, engine.eot, rows, turn2).tokens
    # The conversation keeps what it switched to; a follow-up on the same topic stays there.
    turn3 = follow_up(lm, engine.eot, turn2, tokens2, q2)
    third, _ = ask(engine, turn3)
    assert third.names == second.names and third.cached_tokens == reusable(lm, turn3, kept_ids(lm, turn2, tokens2)) > 0


def test_without_adaptive_a_follow_up_on_another_document_keeps_the_selection(lm, built, engine_of):
    _, engine = engine_of(rag_docs=1)
    turn1 = [{"role": "user", "content": chunk_of(lm, built, "d0.md")}]
    _, tokens1 = ask(engine, turn1)
    second, _ = ask(engine, follow_up(lm, engine.eot, turn1, tokens1, chunk_of(lm, built, "d2.md")))
    assert second.names == ("d0.md",) and second.cached_tokens > 0


def test_switch_rule_on_stubbed_scores():
    ranked = [("c", 0.9), ("a", 0.8), ("b", 0.3)]
    assert switches(ranked, ("a", "b"), 0.05)  # 0.9 beats the best selected (0.8) by 0.1
    assert not switches(ranked, ("a", "b"), 0.2)
    assert not switches(ranked, ("c", "b"), 0.0)  # the best document is already selected
    assert not switches(ranked, ("a", "b", "c"), 0.0)  # nothing outside
    assert switches([("c", 0.1)], ("a",), 0.5)  # a selected document without a scored chunk ranks below all
    assert switches([("c", 0.86), ("a", 0.8)], ("a",), 0.05) and not switches([("c", 0.84), ("a", 0.8)], ("a",), 0.05)


def _kv(rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(2, rows, 8), torch.zeros(2, rows, 8))]


def test_conversations_are_capped_in_entries_and_rows_oldest_first():
    convs = Conversations(max_entries=3, max_rows=100)
    for key in "abc":
        convs.put(key, Conversation(("d",), [1] * 10, _kv(20)))
    assert convs.keys() == ["a", "b", "c"] and convs.rows == 60
    convs.get("a")  # used: now the newest
    convs.put("d", Conversation(("d",), [1], _kv(20)))
    assert convs.keys() == ["c", "a", "d"] and convs.rows == 60 and convs.evicted == 1
    convs.put("e", Conversation(("d",), [1], _kv(70)))  # over 100 rows: the oldest go until it fits
    assert convs.keys() == ["d", "e"] and convs.rows == 90
    convs.put("e", Conversation(("d",), [1], _kv(30)))  # a new turn replaces its conversation's rows
    assert convs.keys() == ["d", "e"] and convs.rows == 50
    convs.put("f", Conversation(("x",), [1], _kv(101)))  # too long to keep: its selection only
    assert convs.get("f") == Conversation(("x",)) and convs.rows == 50
    assert len(convs) == 3


def test_the_selector_keeps_at_most_max_conversations(lm, built, engine_of):
    selector, engine = engine_of(max_conversations=2)
    turns = [[{"role": "user", "content": f"question {i} about rivers"}] for i in range(3)]
    answers = [ask(engine, t)[1] for t in turns]
    described = selector.describe()
    assert described["conversations"] == 2 and described["max_conversations"] == 2
    assert described["conversation_rows"] == sum(32 + len(kept_ids(lm, t, a)) for t, a in zip(turns[1:], answers[1:],
                                                                                              strict=True))
    # The oldest conversation lost its KV; the newer ones kept theirs.
    again, _ = ask(engine, follow_up(lm, engine.eot, turns[0], answers[0]))
    assert again.cached_tokens == 0
    kept, _ = ask(engine, follow_up(lm, engine.eot, turns[2], answers[2]))
    assert kept.cached_tokens == reusable(lm, follow_up(lm, engine.eot, turns[2], answers[2]),
                                          kept_ids(lm, turns[2], answers[2])) > 0


def test_row_cap_drops_conversations_until_the_rows_fit(lm, built, engine_of):
    selector, engine = engine_of(max_conversation_rows=120)
    for i in range(3):  # each kept turn: 32 cartridge rows + ~40 conversation tokens
        ask(engine, [{"role": "user", "content": f"q{i} tell me about castles"}])
        assert selector.describe()["conversation_rows"] <= 120
    assert selector.describe()["conversations"] == 1


def test_reload_opens_the_newer_fleet_and_starts_conversations_over(lm, built, tmp_path, engine_of):
    fleet_dir = tmp_path / "f"
    shutil.copytree(built / "f", fleet_dir)
    selector = FleetSelector(lm, fleet_dir, rag_docs=1)
    engine = Engine(lm, selector, ServeConfig(max_batch=4)).start()
    try:
        q = chunk_of(lm, built, "d0.md")
        turn1 = [{"role": "user", "content": q}]
        first, tokens1 = ask(engine, turn1)
        assert first.names == ("d0.md",) and first.version == 1
        old_rows = selector.select(turn1).rows
        # A long answer decodes while the fleet changes underneath it.
        events: queue.Queue = queue.Queue()
        engine.submit(params([{"role": "user", "content": "a long answer please"}], 400),
                      lambda kind, data: events.put((kind, data)))
        kind, long_accepted = events.get(timeout=60)
        assert kind == "accepted" and long_accepted.version == 1

        docs = write_docs(tmp_path / "docs", words=["apples are red or green fruit", *["x"] * 4])
        for name in ("d1.md", "d2.md"):
            shutil.copy(built / "docs" / name, docs / name)
        run_fleet(Store(tmp_path / "s"), tiny_llama(), [docs], fleet_dir,
                  fleet_preset("smoke", {"rounds": 0, "heldout": 0}), resume=True, log=quiet)
        info = selector.reload()
        assert info["version"] == 2 and info["conversations"] == 0

        new = Fleet.open(fleet_dir, lm)
        sel = selector.select(turn1)
        assert sel.version == 2 and sel.cached_tokens == 0 and sel.names == tuple(new.select(q, k=1))
        assert not torch.equal(new.rows(["d0.md"])[0][0], old_rows[0][0][:, :16])
        assert torch.equal(sel.rows[0][0], new.rows(list(sel.names))[0][0])
        second, _ = ask(engine, follow_up(lm, engine.eot, turn1, tokens1))
        assert second.version == 2 and second.cached_tokens == 0

        tokens = []
        while (item := events.get(timeout=120))[0] != "done":
            assert item[0] == "token"
            tokens.append(item[1])
        assert len(tokens) == 400 or tokens[-1] in engine.eot  # the in-flight stream finished on its rows
        # ...and did not leave its version-1 KV among the new version's conversations.
        assert identity([{"role": "user", "content": "a long answer please"}]) not in selector._state.conversations

        (fleet_dir / "fleet.json").write_text("{broken")
        with pytest.raises(FleetError):
            selector.reload()
        assert selector.describe()["version"] == 2  # the previous version stays in service
        assert ask(engine, turn1)[0].version == 2
    finally:
        engine.stop()


def test_openai_client_round_trip_in_fleet_mode(lm, built, ref):
    selector = FleetSelector(lm, built / "f")
    server = Server(lm, selector, ServeConfig(port=0, api_key="k")).start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["f"]
        health = httpx.get(f"{server.url}/health").json()
        assert health["mode"] == "fleet" and health["documents"] == ["d0.md", "d1.md", "d2.md"]
        assert health["rag_docs"] == 2 and health["p"] == 16

        q = chunk_of(lm, built, "d1.md")
        messages = [{"role": "user", "content": q}]
        raw = client.chat.completions.with_raw_response.create(model="f", messages=messages, max_tokens=8,
                                                                temperature=0)
        first = raw.parse()
        names = ref.select(q, k=2)
        assert first.model_extra["cartridges"] == names and raw.headers["x-cartridges"] == ",".join(names)
        assert first.usage.prompt_tokens_details.cached_tokens == 0 and first.usage.model_extra["cartridge_rows"] == 32
        want = full_prompt_answer(lm, server.engine.eot, ref.rows(names), messages)
        assert first.choices[0].message.content == text(lm, server.engine.eot, want.tokens)

        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Tell me more."}]
        chunks = list(client.chat.completions.create(model="f", messages=messages, max_tokens=8, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        assert usage.prompt_tokens_details.cached_tokens == reusable(lm, messages, kept_ids(lm, messages[:1],
                                                                                          want.tokens)) > 0
        assert usage.prompt_tokens == len(render_prompt(lm.tokenizer, messages))
        assert chunks[0].model_extra["cartridges"] == names
        want2 = full_prompt_answer(lm, server.engine.eot, ref.rows(names), messages)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            text(lm, server.engine.eot, want2.tokens)

        bad = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": "Bearer k"}, timeout=30,
                         json={"model": "f", "messages": [{"role": "system", "content": "only a system turn"}]})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "no_user_message"
        reloaded = httpx.post(f"{server.url}/admin/reload", headers={"Authorization": "Bearer k"}, timeout=30).json()
        assert reloaded["status"] == "reloaded" and reloaded["version"] == 2 and reloaded["mode"] == "fleet"
    finally:
        server.stop()


@pytest.mark.parametrize("argv, message", [
    ([], "either --cartridge FILE (repeatable) or --fleet DIR"),
    (["--cartridge", "a.safetensors", "--fleet", "f"], "not both"),
    (["--cartridge", "a.safetensors", "--rag-docs", "2"], "--rag-docs needs --fleet"),
    (["--cartridge", "a.safetensors", "--rag-adaptive"], "--rag-adaptive needs --fleet"),
    (["--fleet", "f", "--rag-margin", "0.1"], "--rag-margin needs --rag-adaptive"),
    (["--fleet", "f", "--rag-docs", "0"], "--rag-docs must be >= 1"),
    (["--fleet", "NOPE"], "NOPE: no such fleet directory"),
    (["--fleet", "EMPTY"], "no fleet manifest"),
])
def test_serve_flags_are_one_line_errors_before_the_model_loads(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "EMPTY").mkdir()
    assert cli_main(["serve", "--model", "no-such-model", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and err.startswith("error:")


def test_a_server_whose_version_was_pruned_serves_the_live_one_instead_of_failing(lm, built, tmp_path):
    """Cartridges load on first use. A server that missed the reloads of three later versions finds its
    own version removed by retention; the request is answered from the live version, not with a 500."""
    from storage.versions import new_version, prune_versions, publish

    root = tmp_path / "root"
    publish(root, new_version(root, built / "f"))  # 0001
    selector = FleetSelector(lm, root, rag_docs=1)
    assert selector.describe()["fleet_version"] == "0001"
    for _ in range(3):
        publish(root, new_version(root))  # 0002..0004, the server not told
    assert prune_versions(root, keep=3) == ["0001"]
    turn = [{"role": "user", "content": chunk_of(lm, built, "d2.md")}]
    sel = selector.select(turn)  # d2.md's cartridge was never loaded from 0001
    assert sel.fleet_version == "0004" and sel.version == 2
    assert torch.equal(sel.rows[0][0], Fleet.open(root, lm).rows(list(sel.names))[0][0])
