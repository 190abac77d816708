"""Lockstep batched generation against single streams and a cache-free reference loop."""

from __future__ import annotations

import math

import pytest
import torch

from cartridges.core.batch import Stream
from cartridges.core.chat import chat_ids
from cartridges.core.generate import generate
from cartridges.core.prefix import capture_rows
from tests.tiny import TINY, tiny_llama, tiny_qwen3

LENGTHS = (3, 11, 6, 17, 1)
MAX_NEW = (9, 4, 12, 7, 10)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefix_ids(n: int = 8) -> list[int]:
    return prompt(n, seed=99)


def greedy_streams() -> list[Stream]:
    return [Stream(prompt(n, seed=i), max_new=m) for i, (n, m) in enumerate(zip(LENGTHS, MAX_NEW, strict=True))]


def naive_greedy(model: torch.nn.Module, ids: list[int], max_new: int) -> tuple[list[int], list[float]]:
    """Re-run the whole sequence every step with no cache and no mask."""
    seq, margins = list(ids), []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
            top = logits.topk(2).values
            margins.append((top[0] - top[1]).item())
            seq.append(int(logits.argmax().item()))
    return seq[len(ids) :], margins


@pytest.mark.parametrize("with_prefix", [False, True])
@pytest.mark.parametrize("family", sorted(TINY))
def test_batched_greedy_equals_each_stream_alone(family, with_prefix):
    lm = TINY[family](torch.float64)
    rows = capture_rows(lm.model, torch.tensor(prefix_ids())) if with_prefix else None
    streams = greedy_streams()
    batched = generate(lm.model, streams, batch_size=len(streams), prefix_rows=rows)
    alone = [generate(lm.model, [s], batch_size=1, prefix_rows=rows)[0] for s in streams]
    for s, b, a in zip(streams, batched, alone, strict=True):
        assert len(b.tokens) == s.max_new
        assert b.tokens == a.tokens
        assert b.finished == a.finished == "length"
        # Margins read the logits, so a wrong mask shows even where tokens agree.
        assert b.margins == pytest.approx(a.margins, abs=1e-9)


def test_groups_smaller_than_the_input_keep_input_order():
    lm = tiny_llama(torch.float64)
    streams = greedy_streams()
    alone = [generate(lm.model, [s], batch_size=1)[0].tokens for s in streams]
    assert [g.tokens for g in generate(lm.model, streams, batch_size=2)] == alone


@pytest.mark.parametrize("family", sorted(TINY))
def test_single_stream_matches_cache_free_reference(family):
    lm = TINY[family](torch.float64)
    ids = prompt(7, seed=5)
    got = generate(lm.model, [Stream(ids, max_new=10)])[0]
    want, want_margins = naive_greedy(lm.model, ids, 10)
    assert got.tokens == want
    assert got.margins == pytest.approx(want_margins, abs=1e-9)
    assert got.min_margin == min(got.margins)


@pytest.mark.parametrize("family", sorted(TINY))
def test_prefix_rows_match_reference_on_prefix_plus_prompt(family):
    lm = TINY[family](torch.float64)
    head, ids = prefix_ids(), prompt(5, seed=6)
    rows = capture_rows(lm.model, torch.tensor(head))
    got = generate(lm.model, [Stream(ids, max_new=10)], prefix_rows=rows)[0]
    want, want_margins = naive_greedy(lm.model, head + ids, 10)
    assert got.tokens == want
    assert got.margins == pytest.approx(want_margins, abs=1e-9)
    # The prefix must matter, or this test could not tell prefix handling apart.
    bare = generate(lm.model, [Stream(ids, max_new=10)])[0]
    assert max(abs(x - y) for x, y in zip(bare.margins, got.margins, strict=True)) > 1e-3


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_sampled_streams_do_not_depend_on_batch(top_p):
    lm = tiny_llama(torch.float64)
    streams = [
        Stream(prompt(n, seed=i), max_new=m, temperature=0.6, top_p=top_p, seed=100 + i)
        for i, (n, m) in enumerate(zip(LENGTHS, MAX_NEW, strict=True))
    ]
    batched = generate(lm.model, streams, batch_size=len(streams))
    alone = [generate(lm.model, [s], batch_size=1)[0] for s in streams]
    assert [g.tokens for g in batched] == [g.tokens for g in alone]
    greedy = generate(lm.model, greedy_streams(), batch_size=len(streams))
    assert [g.tokens for g in batched] != [g.tokens for g in greedy]


def test_seed_controls_samples_and_tiny_top_p_is_greedy():
    lm = tiny_llama(torch.float64)
    ids = prompt(6, seed=3)
    runs = [generate(lm.model, [Stream(ids, 16, temperature=0.6, seed=s)])[0].tokens for s in (1, 1, 2)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    nucleus = generate(lm.model, [Stream(ids, 16, temperature=0.6, top_p=1e-9, seed=1)])[0]
    assert nucleus.tokens == generate(lm.model, [Stream(ids, 16)])[0].tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_vanishing_temperature_samples_the_greedy_tokens(dtype):
    """1e-228 rounds to 0 in float32 and overflows any logit divided by it: still no NaNs."""
    lm = tiny_llama(dtype)
    ids = prompt(6, seed=5)
    greedy = generate(lm.model, [Stream(ids, 12)])[0].tokens
    for temperature in (1.7e-228, 1e-40, 1e-12):
        assert generate(lm.model, [Stream(ids, 12, temperature=temperature, seed=3)])[0].tokens == greedy


def test_stop_ids_end_a_stream_and_are_included():
    lm = tiny_llama(torch.float64)
    free = greedy_streams()
    plain = generate(lm.model, free, batch_size=len(free))
    target = plain[2].tokens
    stop = target[4]
    cut = target.index(stop) + 1
    stopped = [Stream(s.prompt, s.max_new, stop_ids=(stop,) if i == 2 else ()) for i, s in enumerate(free)]
    got = generate(lm.model, stopped, batch_size=len(stopped))
    assert got[2].tokens == target[:cut]
    assert got[2].tokens[-1] == stop
    assert got[2].finished == "stop"
    for i, (g, s) in enumerate(zip(got, free, strict=True)):
        if i != 2:
            assert g.finished == "length"
            assert len(g.tokens) == s.max_new
            assert g.tokens == plain[i].tokens


def test_retired_streams_leave_the_batch():
    lm = tiny_llama(torch.float64)
    streams = greedy_streams()
    widths: list[int] = []
    handle = lm.model.register_forward_pre_hook(
        lambda _m, _a, kw: widths.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    counted: list[int] = []
    try:
        out = generate(lm.model, streams, batch_size=len(streams), progress=counted.append)
    finally:
        handle.remove()
    # One decode forward per step after the prefill; width = streams still running.
    still = [sum(m > step for m in MAX_NEW) for step in range(1, max(MAX_NEW))]
    assert widths == still
    assert counted == [sum(m > step for m in MAX_NEW) for step in range(max(MAX_NEW))]
    assert sum(counted) == sum(len(g.tokens) for g in out)


def test_zero_budget_and_bad_streams():
    lm = tiny_llama(torch.float64)
    out = generate(lm.model, [Stream([1, 2], max_new=0), Stream([3], max_new=2)])
    assert out[0].tokens == [] and out[0].finished == "length" and out[0].min_margin == math.inf
    assert len(out[1].tokens) == 2
    with pytest.raises(ValueError, match="empty prompt"):
        generate(lm.model, [Stream([], max_new=2)])
    with pytest.raises(ValueError, match="top_p"):
        generate(lm.model, [Stream([1], max_new=2, top_p=0.0)])


QUESTIONS = (
    "What is DEFLATE?",
    "Explain in two sentences why Huffman coding gives frequent symbols shorter codes.",
    "List three file formats that use zlib compression and say briefly what each one stores.",
    "Hi",
)


@pytest.mark.slow
def test_default_model_batched_matches_alone_until_a_near_tie(default_lm):
    tok = default_lm.tokenizer
    streams = [
        Stream(chat_ids(tok, [{"role": "user", "content": q}], add_generation_prompt=True), max_new=24)
        for q in QUESTIONS
    ]
    assert len({len(s.prompt) for s in streams}) == len(streams)
    batched = generate(default_lm.model, streams, batch_size=len(streams))
    alone = [generate(default_lm.model, [s], batch_size=1)[0] for s in streams]
    compared = 0
    for b, a in zip(batched, alone, strict=True):
        for step, (tb, ta) in enumerate(zip(b.tokens, a.tokens, strict=True)):
            if min(b.margins[step], a.margins[step]) < 1e-3:
                break
            assert tb == ta, f"step {step}: batched {tb} vs alone {ta}"
            compared += 1
    assert compared >= 24 * len(streams) // 2


def test_loop_span_ends_a_stream_when_a_window_recurs():
    from stages.synthesize import loop_start

    lm = tiny_qwen3(torch.float64)
    prompt = [5, 9, 13, 200, 31]
    full = generate(lm.model, [Stream(prompt, 40)], batch_size=1)[0]
    assert loop_start(full.tokens, 3) is not None  # this tiny model loops
    cut = generate(lm.model, [Stream(prompt, 40, loop_span=3)], batch_size=1)[0]
    assert cut.finished == "loop"
    assert cut.tokens == full.tokens[: len(cut.tokens)]
    assert loop_start(cut.tokens, 3) == len(cut.tokens) - 3  # stopped on the first recurring window
    assert loop_start(cut.tokens[:-1], 3) is None
