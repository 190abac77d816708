"""Synthesis helpers: loop cutting, question stop tokens, and the stop-at-question lever."""

from __future__ import annotations

from stages.synthesize import loop_start, question_stop_ids
from tests.tiny import tiny_llama, tiny_tokenizer


def test_loop_start_finds_where_a_repeated_span_recurs():
    head = list(range(100, 120))
    cycle = [1, 2, 3, 4, 5, 6, 7]
    tokens = head + cycle * 5
    cut = loop_start(tokens, span=10)
    assert cut == len(head) + len(cycle)  # the second cycle starts the first recurring window
    assert tokens[:cut] == head + cycle


def test_loop_start_leaves_answers_without_loops_alone():
    assert loop_start(list(range(200)), span=10) is None
    assert loop_start([1, 2, 3] * 3, span=10) is None  # shorter than a window


def test_question_stop_ids_are_exactly_tokens_containing_a_question_mark():
    tok = tiny_tokenizer()
    ids = question_stop_ids(tok)
    assert ids == tuple(sorted(i for t, i in tok.get_vocab().items() if "?" in tok.convert_tokens_to_string([t])))
    assert tok.convert_tokens_to_ids("?") in ids and len(ids) >= 1


def _bot_a_stops(monkeypatch, config) -> list[tuple[int, ...]]:
    """The stop ids synthesize_group gives bot A's streams (generation itself is stubbed out)."""
    from cartridges.generate import Generation
    from stages import synthesize

    seen: list[tuple[int, ...]] = []

    def fake_generate(model, streams, batch_size, progress=None, share_min=0):
        if not seen:  # the first call is bot A's
            seen.extend(tuple(s.stop_ids) for s in streams)
        return [Generation(tokens=[], finished="stop") for _ in streams]

    monkeypatch.setattr(synthesize, "generate", fake_generate)
    ids = tiny_tokenizer()("Some text.", add_special_tokens=False)["input_ids"]
    chunk = {"chunk_id": 0, "doc_id": 0, "start": 0, "end": len(ids), "token_ids": ids, "seed_type": "question",
             "split": "train", "rng_seed": 1, "tokens": len(ids)}
    synthesize.synthesize_group(tiny_llama(), [chunk], ["Some text."], config)
    return seen


def test_bot_a_stops_at_a_question_mark_unless_the_lever_is_off(monkeypatch):
    from schemas import SynthConfig

    q = set(question_stop_ids(tiny_tokenizer()))
    on = _bot_a_stops(monkeypatch, SynthConfig())
    off = _bot_a_stops(monkeypatch, SynthConfig(stop_at_question=False))
    assert q <= set(on[0])
    assert not q & set(off[0]) and off[0]  # end-of-turn still stops it


def test_focus_gives_a_spans_conversations_consecutive_sentences_of_their_chunk(monkeypatch):
    """With synth.focus (the default), bot A's prompts about one span quote different whole sentences of it,
    consecutive in the chunk (cyclically); without it, no sentence is quoted."""
    from cartridges.generate import Generation
    from cartridges.seeds import FOCUS_LEAD
    from schemas import SynthConfig
    from stages import synthesize

    tok = tiny_tokenizer()
    whole = [f"Fact number {i} says {w} is true." for i, w in enumerate(["alpha", "beta", "gamma", "delta", "omega"])]
    text = "tail of a cut sentence. " + " ".join(whole) + " A cut"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text

    def prompts(config: SynthConfig) -> list[str]:
        seen: list[str] = []

        def fake_generate(model, streams, batch_size, progress=None, share_min=0):
            if not seen:
                seen.extend(tok.decode(s.prompt) for s in streams)
            return [Generation(tokens=[], finished="stop") for _ in streams]

        monkeypatch.setattr(synthesize, "generate", fake_generate)
        chunks = [{"chunk_id": 14 + i, "doc_id": 0, "start": 100, "end": 100 + len(ids), "token_ids": ids,
                   "seed_type": t, "split": "train", "rng_seed": i, "tokens": len(ids)}
                  for i, t in enumerate(["question", "verbatim", "mechanism", "creative"])]
        synthesize.synthesize_group(tiny_llama(), chunks, [text] * 4, config)
        return seen

    quoted = []
    for prompt in prompts(SynthConfig(focus=True)):
        line = next(x for x in prompt.splitlines() if x.startswith(FOCUS_LEAD))
        quoted.append(line[len(FOCUS_LEAD):].strip())
    first = whole.index(quoted[0])
    assert quoted == [whole[(first + i) % len(whole)] for i in range(4)]
    assert not any(FOCUS_LEAD in p for p in prompts(SynthConfig(focus=False)))
