"""Budgets that follow the corpus, and the plan printed before a run."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest

from cartridges.core.errors import CartridgeError
from jobs.pipeline import pilot_paid, pilot_rates, run_pipeline
from jobs.plan import (
    Rates,
    corpus_tokens,
    earlier_rates,
    fit_minutes,
    pilot_config,
    pilot_key,
    plan_line,
    resolve,
    steps_of,
    taken,
)
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
    assert earlier_rates(store, lm.compute_id) == (None, 0)
    summary = run_pipeline(store, lm, [corpus], cfg)
    tokens = corpus_tokens(lm.tokenizer, [corpus])
    assert summary["p"] == math.ceil(tokens / 60)  # the trained cartridge holds the planned rows
    printed = capsys.readouterr().out
    assert f"plan: {tokens:,} corpus tokens -> {summary['p']:,} rows" in printed and "no estimate yet" in printed
    rates, runs = earlier_rates(store, lm.compute_id)
    # the speeds, put back together for the same config, give the run's own duration (to a step's rounding)
    assert runs == 1 and rates.seconds(resolve(cfg, tokens)) == pytest.approx(summary["seconds"], abs=rates.per_step)
    run_pipeline(store, lm, [corpus], cfg)  # every stage reused: its timings would plan too short
    later = capsys.readouterr().out
    assert f"about {rates.seconds(resolve(cfg, tokens)) / 60:.0f} min on this machine (from 1 earlier run)" in later
    assert earlier_rates(store, lm.compute_id)[1] == 1


def test_a_multi_turn_run_trains_on_every_turn_and_plans_its_steps(tmp_path):
    """synth.turns=2: the plan counts a row per turn, and the run trains on the second turns too."""
    corpus = tmp_path / "c.md"
    corpus.write_text(CORPUS)
    lm, store = tiny_llama(), Store(tmp_path / "s")
    one = preset("smoke", {"synth": {"filter": False}})
    two = preset("smoke", {"synth": {"filter": False, "turns": 2}})
    assert steps_of(two) == math.ceil(2 * one.chunks.conversations * one.train.epochs / one.train.accum)
    assert "conversations of 2 turns" in plan_line(two, 1000, None)
    summary = run_pipeline(store, lm, [corpus], two)
    train_planned = two.chunks.conversations  # held-out conversations come on top
    assert train_planned < summary["conversations"] <= 2 * train_planned


def test_a_time_budget_takes_the_most_conversations_that_fit():
    """fit_minutes against the run-time model it inverts: n fits the minutes, n + 1 does not."""
    for rates, turns, epochs in ((Rates(1.5, 2.3, 200.0), 1, 2), (Rates(1.5, 2.3, 200.0, kept=0.8), 2, 1),
                                 (Rates(0.2, 4.0, 30.0, kept=0.9), 1, 5)):
        cfg = PipelineConfig.from_dict({"budget": {"minutes": 120}, "synth": {"turns": turns},
                                        "train": {"epochs": epochs}})
        fitted = fit_minutes(cfg, rates)
        n = fitted.chunks.conversations
        more = fitted.replace(chunks=fitted.chunks.replace(conversations=n + 1))
        assert rates.seconds(fitted) <= 120 * 60 < rates.seconds(more), (turns, epochs, n)
        paying = fit_minutes(cfg, rates, spent=600.0)  # the pilot's ten minutes come off the budget
        more = paying.replace(chunks=paying.chunks.replace(conversations=paying.chunks.conversations + 1))
        assert 600 + rates.seconds(paying) <= 120 * 60 < 600 + rates.seconds(more), (turns, epochs)
        pilot = 2 * cfg.synth.gen_batch  # two shards synthesized already: they buy more conversations
        ahead = fit_minutes(cfg, rates, spent=600.0, pilot=pilot)
        more = ahead.replace(chunks=ahead.chunks.replace(conversations=ahead.chunks.conversations + 1))
        assert 600 + rates.seconds(ahead, pilot) <= 120 * 60 < 600 + rates.seconds(more, pilot), (turns, epochs)
        assert ahead.chunks.conversations > paying.chunks.conversations
        assert rates.seconds(ahead) - rates.seconds(ahead, pilot) == pytest.approx(pilot * turns * rates.per_row)
    assert abs(Rates(1.0, 1.0, 0.0, kept=0.5).steps(cfg) - steps_of(cfg) / 2) <= 1  # filtered rows take no steps
    with pytest.raises(CartridgeError, match=r"budget.minutes=1: too short .* takes about \d+ min"):
        fit_minutes(PipelineConfig.from_dict({"budget": {"minutes": 1}}), Rates(1.5, 2.3, 200.0))
    with pytest.raises(CartridgeError, match=r"takes about \d+ min here after the pilot's 4.0 min"):
        fit_minutes(PipelineConfig.from_dict({"budget": {"minutes": 4.5}}), Rates(1.5, 2.3, 10.0), spent=240.0)
    with pytest.raises(ConfigError, match="minutes"):
        PipelineConfig.from_dict({"budget": {"minutes": 30, "coverage": 2}})
    sized = PipelineConfig.from_dict({"chunks": {"conversations": 1000, "heldout": 16}, "synth": {"gen_batch": 64}})
    assert "about 102 min on this machine" in plan_line(sized, 3000, Rates(6.0, 0.0, 0.0), "b")  # 1,016 x 6 s
    assert "about 89 min" in plan_line(sized, 3000, Rates(6.0, 0.0, 0.0), "b", pilot=128)  # the pilot's 128 made
    nothing_kept = {"steps": 0, "conversation_rows": 64, "stages": [], "seconds": 9.0, "train_seconds": 0.0,
                    "train_conversations": 0, "train_rows": 56}
    with pytest.raises(CartridgeError, match="pilot run trained no step .* kept none of its 64"):
        Rates.of(nothing_kept)


def test_the_default_and_large_presets_are_time_budgets_that_given_conversations_replace():
    assert preset("default").budget.minutes == 30 and preset("large").budget.minutes == 120
    assert preset("default", {"chunks": {"conversations": 500}}).budget.minutes is None
    given = preset("large", {"chunks": {"conversations": 500}})
    assert given.budget.minutes is None and given.chunks.conversations == 500
    assert preset("large", {"budget": {"coverage": 2}}).budget.minutes is None  # so is coverage
    assert preset("large", {"budget": {"minutes": 30}}).budget.minutes == 30


def test_a_pilot_measures_the_machine_once_and_the_run_fits_its_minutes(tmp_path, capsys):
    corpus = tmp_path / "c.md"
    corpus.write_text(CORPUS)
    lm, store = tiny_llama(), Store(tmp_path / "s")
    cfg = preset("smoke", {"synth": {"filter": False}, "budget": {"minutes": 0.5}})
    rates, source, pilot = pilot_rates(store, lm, [corpus], cfg, None)
    pilots = [r for r in store.catalog.runs() if r["flow"] == "pilot"]
    assert len(pilots) == 1 and pilots[0]["status"] == "complete" and "measured by pilot run" in source
    assert pilot == {"run_id": pilots[0]["run_id"], "seconds": pilots[0]["summary"]["seconds"],
                     "conversations": pilots[0]["summary"]["conversations"]}
    # the pilot ran in this store, its stages recorded under its run: the run it sizes takes them over
    (made,) = store.catalog.artifacts("synthesize")
    assert made.run_id == pilot["run_id"] and pilot["conversations"] == pilots[0]["summary"]["conversations"]
    assert rates.per_row > 0 and rates.per_step > 0 and rates.fixed >= 0 and 0 < rates.kept <= 1
    assert pilots[0]["summary"]["conversations"] >= cfg.synth.gen_batch  # a shard, held-out ones included
    # the speeds, put back together, give the pilot's own duration
    assert rates.seconds(pilot_config(cfg)) == pytest.approx(pilots[0]["summary"]["seconds"], rel=1e-6)

    # the run sizes itself from the recorded pilot; give it speeds that make the size exact
    slow = Rates(per_row=0.5, per_step=1.0, fixed=3.0, kept=0.5)
    with store.catalog._connect() as con:  # noqa: SLF001 - the test sets the speeds a pilot recorded
        con.execute("UPDATE runs SET summary = ? WHERE run_id = ?",
                    [json.dumps({**pilots[0]["summary"], "rates": dataclasses.asdict(slow)}), pilots[0]["run_id"]])
    capsys.readouterr()
    assert not pilot_paid(store, pilot["run_id"])
    summary = run_pipeline(store, lm, [corpus], cfg)
    # the first run it sizes pays for the pilot, and the pilot's synthesis costs it nothing
    fitted = fit_minutes(cfg, slow, pilot["seconds"], pilot["conversations"])
    estimate = slow.seconds(fitted, pilot["conversations"])
    assert summary["budget"]["minutes"] == 0.5 and summary["budget"]["estimate_seconds"] == estimate
    share = taken(fitted, pilot["conversations"])
    full = pilot["conversations"] // cfg.synth.gen_batch * cfg.synth.gen_batch  # the pilot's full shards
    assert summary["budget"]["taken"] == share == full > 0 and estimate < slow.seconds(fitted)
    synthesized, by_pilot = (store.table(a).to_pylist() for a in (store.latest("synthesize"), made))
    assert synthesized[:full] == by_pilot[:full] and len(synthesized) > full  # in shard order
    assert summary["budget"]["pilot"] == pilot["run_id"] and summary["budget"]["pilot_seconds"] == pilot["seconds"]
    assert summary["budget"]["conversations"] == fitted.chunks.conversations
    assert pilot_paid(store, pilot["run_id"])  # later runs it sizes get their whole minutes
    assert 0 < fitted.chunks.conversations < summary["planned_conversations"] <= fitted.chunks.conversations + 16
    printed = capsys.readouterr().out
    paid = f"budget: 0.5 min, after the pilot's {pilot['seconds'] / 60:.1f} min -> {fitted.chunks.conversations:,} conv"
    assert paid in printed and "from pilot run" in printed
    assert f"synthesize: {share} of {summary['planned_conversations']} conversations taken" in printed
    steps = slow.steps(fitted)  # the plan counts only the conversations the filter keeps
    assert f" {steps:,} training steps" in printed and steps < steps_of(fitted)
    assert len([r for r in store.catalog.runs() if r["flow"] == "pilot"]) == 1  # no second pilot
    longer = cfg.replace(budget=cfg.budget.replace(minutes=0.6))  # a later run at other minutes: all of them
    again = run_pipeline(store, lm, [corpus], longer)
    assert again["budget"]["pilot_seconds"] == 0.0
    longer_fit = fit_minutes(longer, slow, 0.0, pilot["conversations"])
    assert again["budget"]["estimate_seconds"] == slow.seconds(longer_fit, pilot["conversations"])
    reseeded = cfg.replace(chunks=cfg.chunks.replace(seed=8))  # the same speeds, none of the pilot's shards
    assert pilot_rates(store, lm, [corpus], reseeded, None)[2]["conversations"] == 0
    shutil.rmtree(store.dir(made))  # collected: the next run synthesizes them again, and is sized so
    assert pilot_rates(store, lm, [corpus], cfg, None)[2] == {**pilot, "conversations": 0}
    # the pilot's rates are this store's earlier rates too (the runs that took its shards time short)
    assert earlier_rates(store, lm.compute_id) == (slow, 1)


def test_a_pilot_is_found_again_by_what_the_stages_fingerprint(tmp_path, monkeypatch):
    corpus = tmp_path / "c.md"
    corpus.write_text(CORPUS)
    cfg = preset("smoke", {"budget": {"minutes": 30}})
    key = pilot_key(pilot_config(cfg), "m", [corpus])
    checkpoints = cfg.replace(train=cfg.train.replace(save_every=5), budget=cfg.budget.replace(minutes=90))
    assert pilot_key(pilot_config(checkpoints), "m", [corpus]) == key  # how it runs and how long: same speeds
    reseeded = preset("smoke", {"budget": {"minutes": 30}, "chunks": {"seed": 8}, "synth": {"seed": 8},
                                "train": {"seed": 8}})
    assert pilot_key(pilot_config(reseeded), "m", [corpus]) == key  # other spans and questions, same lengths
    assert pilot_key(pilot_config(cfg.replace(train=cfg.train.replace(p=32))), "m", [corpus]) != key
    assert pilot_key(pilot_config(cfg), "other dtype", [corpus]) != key
    corpus.write_text(CORPUS + " More text.")
    assert pilot_key(pilot_config(cfg), "m", [corpus]) != key
    corpus.write_text(CORPUS)
    monkeypatch.setattr("jobs.plan.machine_id", lambda: "vm | AMD EPYC | AVX512 | 2 cpus | torch 2.13.0")
    assert pilot_key(pilot_config(cfg), "m", [corpus]) != key  # same host name, another CPU under it
    assert pilot_config(cfg, workers=2).chunks.conversations == max(cfg.chunks.per_chunk,
                                                                    2 * cfg.synth.gen_batch - cfg.chunks.heldout)
