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
    from cartridges.core.generate import Generation
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
    from cartridges.core.generate import Generation
    from cartridges.selfstudy.seeds import FOCUS_LEAD
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


def test_a_document_teacher_answers_with_the_whole_document_and_bot_a_still_sees_the_chunk(monkeypatch):
    """teacher_context "document": bot B's prompt, and so the teacher sequence, holds the chunk's whole
    document; the kept targets are the model's distributions behind a real prefill of it."""
    import torch

    from cartridges.core.chat import system_ids
    from schemas import SynthConfig
    from stages import synthesize

    lm = tiny_llama(torch.float64)
    tok = lm.tokenizer
    chunk_text = "Gamma rays are short."
    document = "Alpha rays are slow. Beta rays are fast. " + chunk_text + " Delta is a river mouth."
    ids = tok(chunk_text, add_special_tokens=False)["input_ids"]
    chunks = [{"chunk_id": i, "doc_id": 0, "start": 0, "end": len(ids), "token_ids": ids, "seed_type": "question",
               "split": "train", "rng_seed": i, "tokens": len(ids)} for i in range(2)]
    a_prompts: list[str] = []
    real_generate = synthesize.generate

    def spy(model, streams, batch_size, progress=None, share_min=0):
        if not a_prompts:
            a_prompts.extend(tok.decode(s.prompt) for s in streams)
        return real_generate(model, streams, batch_size=batch_size, progress=progress, share_min=share_min)

    monkeypatch.setattr(synthesize, "generate", spy)
    config = SynthConfig(max_q=6, max_a=5, filter=False, focus=False, teacher_context="document")
    rows = synthesize.synthesize_group(lm, chunks, [chunk_text] * 2, config, answer_contexts=[document] * 2)
    assert all(chunk_text in p and "Alpha rays" not in p for p in a_prompts)
    for row in rows:
        head = system_ids(tok, document)
        assert row["teacher_ids"] == head + row["student_ids"] and "Alpha rays" not in tok.decode(row["student_ids"])
        start = row["answer_start"]
        assert row["answer_topk_ids"]  # bot B answered: its targets are checked below
        with torch.no_grad():
            logits = lm.model(torch.tensor([row["teacher_ids"]])).logits[0].double()
        logprobs = torch.log_softmax(logits, dim=-1)
        for j, (top_ids, top_lps) in enumerate(zip(row["answer_topk_ids"], row["answer_topk_logprobs"], strict=True)):
            want = logprobs[start + j - 1, top_ids]
            assert torch.allclose(torch.tensor(top_lps, dtype=torch.float64), want, atol=1e-6)


def test_a_document_too_long_for_the_models_context_is_refused_by_name():
    import pytest

    from cartridges.core.errors import CartridgeError
    from schemas import ConfigError, SynthConfig
    from stages.synthesize import document_contexts

    docs = [{"doc_id": 0, "name": "short.md", "tokens": 100, "text": "Short."},
            {"doc_id": 1, "name": "long.md", "tokens": 4000, "text": "Long."}]
    config = SynthConfig(teacher_context="document")
    with pytest.raises(CartridgeError, match=r"long\.md \(4000 tokens\)"):
        document_contexts(docs, config, limit=4096)
    assert document_contexts(docs, config, limit=8192) == {0: "Document: short.md\n\nShort.",
                                                           1: "Document: long.md\n\nLong."}
    with pytest.raises(ConfigError, match="teacher_context"):
        SynthConfig(teacher_context="corpus")


def test_the_cli_sets_the_teacher_context_and_refuses_other_values(capsys):
    import pytest

    from cli.main import build_parser, pipeline_config

    parser = build_parser()
    args = parser.parse_args(["train", "--corpus", "x.md", "--teacher-context", "document"])
    assert pipeline_config(args).synth.teacher_context == "document"
    assert pipeline_config(parser.parse_args(["train", "--corpus", "x.md"])).synth.teacher_context == "chunk"
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--corpus", "x.md", "--teacher-context", "corpus"])
    assert "invalid choice: 'corpus'" in capsys.readouterr().err


def test_fleet_self_study_gives_bot_b_the_target_document_under_a_document_teacher(monkeypatch):
    from schemas import SynthConfig, TeacherConfig
    from stages import fleet_data

    lm = tiny_llama()
    tok = lm.tokenizer
    text = "Alpha rays are slow. Beta rays are fast."
    doc = {"name": "rays.md", "sha256": "x", "token_ids": tok(text, add_special_tokens=False)["input_ids"]}
    rows = [{"chunk_id": 0, "doc_id": 0, "start": 0, "end": 5, "tokens": 5, "seed_type": "question",
             "split": "train", "rng_seed": 1, "token_ids": doc["token_ids"][:5]}]
    seen = {}

    def fake_group(lm, chunks, contexts, config, answer_contexts=None):
        seen.update(contexts=contexts, answers=answer_contexts)
        return []

    class Ctx:
        def write_shard(self, *args, **kwargs):
            pass

    monkeypatch.setattr(fleet_data, "synthesize_group", fake_group)
    fleet_data._conversations(Ctx(), lm, rows, doc, SynthConfig(teacher_context="document"), TeacherConfig())
    assert seen["answers"] == [text] and seen["contexts"] == [tok.decode(doc["token_ids"][:5])]
    fleet_data._conversations(Ctx(), lm, rows, doc, SynthConfig(), TeacherConfig())
    assert seen["answers"] is None


def test_a_second_turn_holds_the_first_and_its_kept_targets_are_a_real_forwards(monkeypatch):
    """synth.turns=2: each conversation's turn-2 row carries turn 1 in its teacher and student
    sequences (conv_id = chunk_id * 2 + turn), bot A asks afresh about the chunk, and the targets
    bot B kept for the second answer are the model's distributions behind a real prefill of the
    whole conversation."""
    import torch

    from cartridges.core.chat import chat_ids, system_ids
    from schemas import SynthConfig
    from stages import synthesize

    lm = tiny_llama(torch.float64)
    tok = lm.tokenizer
    text = "Gamma rays are short. Delta is a river mouth."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    chunks = [{"chunk_id": i, "doc_id": 0, "start": 0, "end": len(ids), "token_ids": ids, "seed_type": "question",
               "split": "train", "rng_seed": i, "tokens": len(ids)} for i in range(3)]
    prompts: list[list[list[int]]] = []
    real_generate = synthesize.generate

    def spy(model, streams, batch_size, progress=None, share_min=0):
        prompts.append([list(s.prompt) for s in streams])
        return real_generate(model, streams, batch_size=batch_size, progress=progress, share_min=share_min)

    monkeypatch.setattr(synthesize, "generate", spy)
    config = SynthConfig(max_q=6, max_a=5, filter=False, focus=False, turns=2)
    rows = synthesize.synthesize_group(lm, chunks, [text] * 3, config)
    first = {r["chunk_id"]: r for r in rows if r["conv_id"] % 2 == 0}
    second = [r for r in rows if r["conv_id"] % 2 == 1]
    assert sorted(first) == [0, 1, 2] and [r["conv_id"] for r in first.values()] == [0, 2, 4]
    assert second, "no conversation reached its second turn"
    assert len(prompts) == 4  # bot A and bot B, per turn
    assert all(p in prompts[0] for p in prompts[2])  # bot A's second prompt is a first-turn prompt
    head = system_ids(tok, text)
    for row in second:
        before = first[row["chunk_id"]]
        messages = [{"role": "system", "content": text}, {"role": "user", "content": before["question"]},
                    {"role": "assistant", "content": before["answer"]}, {"role": "user", "content": row["question"]}]
        prompt = chat_ids(tok, messages, add_generation_prompt=True)
        assert row["teacher_ids"][: row["answer_start"]] == prompt and row["conv_id"] == row["chunk_id"] * 2 + 1
        assert row["teacher_ids"] == head + row["student_ids"]
        assert row["student_answer_start"] == row["answer_start"] - len(head)
        with torch.no_grad():
            logits = lm.model(torch.tensor([row["teacher_ids"]])).logits[0].double()
        logprobs = torch.log_softmax(logits, dim=-1)
        start = row["answer_start"]
        assert len(row["answer_topk_ids"]) == len(row["teacher_ids"]) - start
        for j, (top_ids, top_lps) in enumerate(zip(row["answer_topk_ids"], row["answer_topk_logprobs"], strict=True)):
            assert torch.allclose(torch.tensor(top_lps, dtype=torch.float64), logprobs[start + j - 1, top_ids], atol=1e-6)


def _scripted(monkeypatch, questions: list[str], answer: str):
    """generate stubbed: bot A's call n returns questions[n] for every stream, bot B always `answer`."""
    from cartridges.core.chat import end_of_turn_ids
    from cartridges.core.generate import Generation
    from stages import synthesize

    tok = tiny_tokenizer()
    eot = end_of_turn_ids(tok)[0]
    calls = []

    def fake(model, streams, batch_size, progress=None, share_min=0):
        text = answer if len(calls) % 2 else questions[len(calls) // 2]
        calls.append(text)
        ids = tok(text, add_special_tokens=False)["input_ids"] + [eot]
        return [Generation(tokens=list(ids), finished="stop") for _ in streams]

    monkeypatch.setattr(synthesize, "generate", fake)
    return calls


def test_one_turn_keeps_conv_ids_and_a_failed_or_repeated_turn_ends_its_conversation(monkeypatch):
    from schemas import SynthConfig
    from stages import synthesize

    ids = tiny_tokenizer()("Some text.", add_special_tokens=False)["input_ids"]
    chunks = [{"chunk_id": i, "doc_id": 0, "start": 0, "end": len(ids), "token_ids": ids, "seed_type": "question",
               "split": "train", "rng_seed": i, "tokens": len(ids)} for i in (4, 9)]
    lm = tiny_llama()
    _scripted(monkeypatch, ["", "", ""], "An answer of some words.")
    one = synthesize.synthesize_group(lm, chunks, ["Some text."] * 2, SynthConfig())
    assert [r["conv_id"] for r in one] == [4, 9]
    # an empty question fails the filter, so no conversation goes on to a second turn
    two = synthesize.synthesize_group(lm, chunks, ["Some text."] * 2, SynthConfig(turns=3))
    assert [r["conv_id"] for r in two] == [12, 27] and not any(r["a_ok"] for r in two)
    # a second turn asking the first question again is a repeat and ends the conversation
    calls = _scripted(monkeypatch, ["What is the rule of the text?", " what is the  rule of the text?"],
                      "The rule is that servers vote once.")
    rows = synthesize.synthesize_group(lm, chunks, ["Some text."] * 2, SynthConfig(turns=3))
    assert [r["conv_id"] for r in rows] == [12, 13, 27, 28] and len(calls) == 4
    assert [(r["a_ok"], r["a_reason"]) for r in rows] == [(True, ""), (False, "repeat")] * 2
    assert all(r["b_ok"] for r in rows[::2]) and not any(r["answer"] for r in rows[1::2])


def test_turns_out_of_range_are_refused_by_name():
    import pytest

    from schemas import SynthConfig

    for bad in (0, 5):
        with pytest.raises(ValueError, match="turns"):
            SynthConfig(turns=bad)


def test_bot_a_samples_inside_its_nucleus_and_a_one_token_nucleus_is_greedy(monkeypatch):
    """top_p_a reaches bot A's streams (and only bot A's); cut to one token, conversations whose
    sampling seeds differ ask the same greedy question, where the full distribution lets them differ."""
    import torch

    from schemas import SynthConfig
    from stages import synthesize

    lm = tiny_llama(torch.float64)
    ids = lm.tokenizer("Gamma rays are short and fast.", add_special_tokens=False)["input_ids"]
    chunks = [{"chunk_id": i, "doc_id": 0, "start": 0, "end": len(ids), "token_ids": ids, "seed_type": "question",
               "split": "train", "rng_seed": 1000 + i, "tokens": len(ids)} for i in range(6)]
    top_ps: list[list[float]] = []
    real_generate = synthesize.generate

    def spy(model, streams, batch_size, progress=None, share_min=0):
        top_ps.append([s.top_p for s in streams])
        return real_generate(model, streams, batch_size=batch_size, progress=progress, share_min=share_min)

    monkeypatch.setattr(synthesize, "generate", spy)

    def questions(**changes) -> list[str]:
        config = SynthConfig(max_q=8, max_a=2, filter=False, focus=False, temperature_a=2.0, **changes)
        rows = synthesize.synthesize_group(lm, chunks, ["Gamma rays are short and fast."] * len(chunks), config)
        return [r["question"] for r in rows]

    narrow = questions(top_p_a=1e-9)
    assert top_ps[0] == [1e-9] * len(chunks) and top_ps[1] == [1.0] * len(chunks)  # bot A, then bot B
    assert len(set(narrow)) == 1
    wide = questions()
    assert top_ps[2] == [1.0] * len(chunks)
    assert len(set(wide)) > 1


def test_a_nucleus_outside_zero_to_one_is_refused_by_name():
    import pytest

    from schemas import ConfigError, SynthConfig

    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ConfigError, match="top_p_a"):
            SynthConfig(top_p_a=bad)
