"""Budgets that follow the corpus, and the plan printed before a run."""

from __future__ import annotations

import math

import pytest

from jobs.pipeline import run_pipeline
from jobs.plan import corpus_tokens, estimate_seconds, plan_line, resolve, steps_of
from schemas import PipelineConfig
from schemas.configs import ConfigError
from schemas.presets import preset
from storage import Store
from tests.tiny import tiny_llama

CORPUS = "Prefix caches hold keys and values. A cartridge is trained offline by self-study. " * 12


def test_rows_and_conversations_follow_the_corpus():
    cfg = PipelineConfig.from_dict({"budget": {"compression": 10, "coverage": 2}})
    out = resolve(cfg, 3000)
    assert out.train.p == 300
    span = (cfg.chunks.chunk_min + cfg.chunks.chunk_max) / 2
    assert out.chunks.conversations == math.ceil(2 * 3000 / span) * cfg.chunks.per_chunk
    assert resolve(PipelineConfig(), 3000) == PipelineConfig()  # no budget: the config as given
    with pytest.raises(ConfigError, match="compression"):
        PipelineConfig.from_dict({"budget": {"compression": 0}})


def test_a_run_prints_its_plan_and_later_runs_estimate_from_the_earlier_ones(tmp_path, capsys):
    corpus = tmp_path / "c.md"
    corpus.write_text(CORPUS)
    lm, store = tiny_llama(), Store(tmp_path / "s")
    cfg = preset("smoke", {"synth": {"filter": False}, "budget": {"compression": 60}})
    assert estimate_seconds(store, lm.compute_id, cfg) == (None, 0)
    summary = run_pipeline(store, lm, [corpus], cfg)
    tokens = corpus_tokens(lm.tokenizer, [corpus])
    assert summary["p"] == math.ceil(tokens / 60)  # the trained cartridge holds the planned rows
    printed = capsys.readouterr().out
    assert f"plan: {tokens:,} corpus tokens -> {summary['p']:,} rows" in printed and "no estimate yet" in printed
    seconds, runs = estimate_seconds(store, lm.compute_id, resolve(cfg, tokens))
    expected = (cfg.chunks.conversations * summary["s_per_conversation"]
                + steps_of(cfg) * summary["train_seconds"] / summary["steps"])
    assert runs == 1 and seconds == pytest.approx(expected)
    assert "from 1 earlier run)" in plan_line(resolve(cfg, tokens), tokens, (seconds, runs))


def test_a_multi_turn_run_trains_on_every_turn_and_plans_its_steps(tmp_path):
    """synth.turns=2: the plan counts a row per turn, and the run trains on the second turns too."""
    corpus = tmp_path / "c.md"
    corpus.write_text(CORPUS)
    lm, store = tiny_llama(), Store(tmp_path / "s")
    one = preset("smoke", {"synth": {"filter": False}})
    two = preset("smoke", {"synth": {"filter": False, "turns": 2}})
    assert steps_of(two) == math.ceil(2 * one.chunks.conversations * one.train.epochs / one.train.accum)
    assert "conversations of 2 turns" in plan_line(two, 1000, (None, 0))
    summary = run_pipeline(store, lm, [corpus], two)
    train_planned = two.chunks.conversations  # held-out conversations come on top
    assert train_planned < summary["conversations"] <= 2 * train_planned
