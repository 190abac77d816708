"""experiments.fleet_quality scores what `cartridges eval` scores: alone as its fleet_oracle arm,
composed as a cartridge file holding the whole fleet's rows."""

from __future__ import annotations

import json

import pytest

from cartridges.core.cartridge import Cartridge
from cartridges.core.files import save_cartridge
from cartridges.evaluation.evaluate import score_arm
from cartridges.evaluation.qa import read_questions
from cartridges.fleet import Fleet
from experiments.fleet_quality import change, evaluate
from jobs.fleet import run_fleet
from schemas.presets import fleet_preset
from stages import evaluate as eval_stage
from storage import Store
from tests.test_fleet_run import write_docs
from tests.tiny import tiny_llama

QUESTIONS = [
    {"doc": "d0.md", "question": "Where do apples grow?", "options": ["orchards", "orbit"], "answer": 0},
    {"doc": "d0.md", "question": "What grows in orchards?", "options": ["rockets", "apples"], "answer": 1},
    {"doc": "d1.md", "question": "Where do rockets fly?", "options": ["orchards", "orbit"], "answer": 1},
    {"doc": "d1.md", "question": "What flies to orbit?", "options": ["rockets", "apples"], "answer": 0},
]


def test_alone_and_composed_match_the_eval_stage_on_one_document(tmp_path):
    lm = tiny_llama()
    docs_dir = write_docs(tmp_path / "docs", 2)
    run_fleet(Store(tmp_path / "s"), lm, [docs_dir], tmp_path / "f", fleet_preset("smoke"), log=lambda _: None)
    qa = tmp_path / "q.jsonl"
    qa.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    questions, _ = read_questions(qa)
    corpus = [str(p) for p in sorted(docs_dir.iterdir())]
    docs = eval_stage.read_docs(corpus)
    reference = {a.name: score_arm(lm, a, questions, likelihood_only=True)[0]
                 for a in eval_stage.Inputs(lm, [], docs).arms(peers=False) if a.name in ("bare", "icl")}

    out = evaluate(lm, tmp_path / "f", docs, questions, reference)

    mine = [q for q in questions if q.doc == "d0.md"]
    alone = eval_stage.run(Store(tmp_path / "e1"), lm, str(qa), mine, [], [], corpus, max_new=4,
                           log=lambda _: None, fleet_dir=str(tmp_path / "f"))
    fleet = Fleet.open(tmp_path / "f", lm)
    path = save_cartridge(tmp_path / "all.safetensors", Cartridge.from_rows(fleet.rows(fleet.names), frozen=0),
                          lm.fingerprint)
    composed = eval_stage.run(Store(tmp_path / "e2"), lm, str(qa), mine, [], [str(path)], corpus, max_new=4,
                              log=lambda _: None)
    d0 = out["d0.md"]
    assert d0["alone"]["questions"] == 2 and out["d1.md"]["alone"]["questions"] == 2
    assert d0["alone"]["gold_nll"] == pytest.approx(alone["arms"]["fleet_oracle"]["gold_nll"], rel=1e-5)
    assert d0["alone"]["accuracy"] == pytest.approx(alone["arms"]["fleet_oracle"]["accuracy"])
    assert d0["composed"]["gold_nll"] == pytest.approx(composed["arms"]["cartridge"]["gold_nll"], rel=1e-5)
    assert d0["composed"]["gold_nll"] != pytest.approx(d0["alone"]["gold_nll"], rel=1e-6)  # the other rows count
    bare, icl = (alone["arms"][a]["gold_nll"] for a in ("bare", "icl"))
    for arm in ("alone", "composed"):
        expected = (bare - d0[arm]["gold_nll"]) / (bare - icl) if icl < bare else None
        assert d0[arm]["nll_closure"] == (None if expected is None else pytest.approx(expected, rel=1e-5))

    # The paired change pools each document's mean change over its own bare-to-ICL gap.
    expected = []
    for cell in out.values():
        rows = list(cell["by_question"].values())
        gap = sum(r["bare"] - r["icl"] for r in rows) / len(rows)
        expected.append(-sum(r["composed"] - r["alone"] for r in rows) / len(rows) / gap if gap > 0 else None)
    got = change({"documents": out}, {"documents": out}, "alone", "composed")["closure_change"]
    if None in expected:
        assert got is None
    else:
        assert got == pytest.approx(sum(expected) / len(expected), rel=1e-6)
    assert out["d0.md"]["by_question"]["0"]["alone"] == pytest.approx(
        alone["arms"]["fleet_oracle"]["gold_nll"] * 2 - out["d0.md"]["by_question"]["1"]["alone"], rel=1e-5)
