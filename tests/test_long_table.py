"""The long-corpus table's runner: the order of its points, resuming, and the closure and
paired-difference arithmetic against a direct computation."""

from __future__ import annotations

import json
import statistics

import pytest

from experiments import long_table as lt


def record(corpus: str, budget: int, arm: str, nll: list[float], correct: list[int], seed: int = 0) -> dict:
    return {"corpus": corpus, "budget": budget, "arm": arm, "seed": seed, "conversations": 0, "train": None, "wall_s": 1.0,
            "reason": None, "kv_rows": budget or 30, "kv_bytes": 1024.0, "ttft_s": 0.1,
            "accuracy": statistics.mean(correct), "gold_nll": statistics.mean(nll),
            "questions": [{"line": i + 1, "doc": "a", "region": "middle", "correct": c, "gold_nll": n, "kv_rows": 30}
                          for i, (n, c) in enumerate(zip(nll, correct, strict=True))]}


def write_records(path, records: list[dict]) -> None:
    """Records as the runner appends them: one JSON line per finished point."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps({**r, "version": lt.VERSION}) + "\n")


def test_points_put_references_first_then_each_budget_whole():
    got = lt.points(["c"], [512, 2048], ["bare", "icl_oracle", "rag", "cartridge"], [7])
    assert got == [("c", 0, "bare", 0), ("c", 0, "icl_oracle", 0), ("c", 512, "rag", 0), ("c", 512, "cartridge", 7),
                   ("c", 2048, "rag", 0), ("c", 2048, "cartridge", 7)]


def test_closure_and_paired_difference_match_a_direct_computation():
    bare = record("c", 0, "bare", [5.0, 6.0, 4.0, 5.0], [0, 0, 1, 0])
    oracle = record("c", 0, "icl_oracle", [3.0, 2.0, 2.0, 3.0], [1, 1, 1, 0])
    rag = record("c", 512, "rag", [4.0, 3.0, 3.0, 5.0], [1, 0, 1, 0])
    cart = record("c", 512, "cartridge", [4.5, 4.0, 3.0, 4.0], [0, 1, 1, 1])
    gap = statistics.mean([5 - 3, 6 - 2, 4 - 2, 5 - 3])  # 2.5
    c = lt.closure_of(cart, bare, oracle)
    assert c["value"] == pytest.approx((5.0 - statistics.mean([4.5, 4.0, 3.0, 4.0])) / gap)
    assert c["ci"][0] <= c["value"] <= c["ci"][1]
    d = lt.paired(cart, rag, bare, oracle)
    assert d["closure"] == pytest.approx(statistics.mean([(4 - 4.5) / gap, (3 - 4) / gap, 0.0, (5 - 4) / gap]))
    assert d["accuracy"] == pytest.approx(statistics.mean([-1, 1, 0, 1]))
    assert d["closure_ci"][0] <= d["closure"] <= d["closure_ci"][1]
    worse = record("c", 0, "icl_oracle", [6.0, 7.0, 5.0, 6.0], [0, 0, 0, 0])  # a ceiling below bare has no closure
    assert lt.closure_of(cart, bare, worse)["value"] is None


def test_the_table_reads_the_records_and_a_rerun_skips_finished_points(tmp_path, monkeypatch):
    out = tmp_path / "long"
    calls = []

    def fake_point(corpus, arm, budget, seed):
        calls.append((arm, budget, seed))
        nll = {"bare": 5.0, "icl_oracle": 3.0, "icl_window": 4.0, "rag": 3.5}.get(arm, 4.2)
        return record(corpus.name, budget, arm, [nll, nll + 0.5, nll - 0.5], [1, 0, 1], seed)

    monkeypatch.setattr(lt, "score_point", fake_point)
    monkeypatch.setattr("cartridges.core.models.load_model", lambda *a: object())
    arms = ["bare", "icl_oracle", "icl_window", "rag", "snapkv"]
    first = lt.run(["packaging-peps"], [512], arms, [7], 16, out, tmp_path / "store", "float32")
    assert len(first["ran"]) == 5 and calls[:2] == [("bare", 0, 0), ("icl_oracle", 0, 0)]
    again = lt.run(["packaging-peps"], [512], arms, [7], 16, out, tmp_path / "store", "float32")
    assert again["ran"] == [] and again["skipped"] == 5 and len(calls) == 5
    (out / "packaging-peps.jsonl").open("a").write('{"corpus": "packaging-pe')  # a write cut by a kill
    result = lt.table(out)
    rows = {r["arm"]: r for r in result["corpora"]["packaging-peps"]["rows"]}
    assert rows["icl_oracle"]["closure"]["value"] == pytest.approx(1.0)
    assert rows["rag"]["closure"]["value"] == pytest.approx(0.75)
    assert rows["snapkv"]["vs_rag"]["closure"] == pytest.approx((3.5 - 4.2) / 2.0)
    assert "vs_rag" not in rows["rag"]
    assert "| 512 | snapkv |" in lt.markdown(result)
    json.dumps(result)  # what --json prints


def test_fleet_rag_is_paired_against_rag_at_half_its_budget(tmp_path):
    """fleet_rag's chunk half alone is `rag` at half the budget: the pair isolates the cartridge half."""
    out = tmp_path / "long"
    recs = [record("c", 0, "bare", [5.0, 6.0, 4.0], [0, 0, 1]), record("c", 0, "icl_oracle", [3.0, 2.0, 2.0], [1, 1, 1]),
            record("c", 512, "rag", [3.0, 4.0, 2.5], [1, 0, 1]), record("c", 1024, "rag", [3.5, 3.0, 3.0], [1, 1, 0]),
            record("c", 1024, "fleet_rag", [3.0, 3.5, 2.0], [1, 1, 1], seed=7)]
    write_records(out / "c.jsonl", recs)
    result = lt.table(out)
    rows = {(r["budget"], r["arm"]): r for r in result["corpora"]["c"]["rows"]}
    gap = statistics.mean([2.0, 4.0, 2.0])
    half = rows[(1024, "fleet_rag")]["vs_rag_half"]
    assert half["closure"] == pytest.approx(statistics.mean([0.0, 0.5, 0.5]) / gap)
    assert half["accuracy"] == pytest.approx(statistics.mean([0, 1, 0]))
    assert rows[(1024, "fleet_rag")]["vs_rag"]["closure"] == pytest.approx(statistics.mean([0.5, -0.5, 1.0]) / gap)
    assert "vs_rag_half" not in rows[(1024, "rag")]
    assert "`fleet_rag` at 1024 against `rag` at 512 (its chunks alone), paired: closure +0.125" in lt.markdown(result)


def test_an_arm_on_two_seeds_enters_the_table_as_its_seed_mean(tmp_path):
    """Each seed keeps its row; the seed mean averages each question's gold NLL over the seeds, and the
    mean over corpora counts that mean once, not each seed."""
    out = tmp_path / "long"
    recs = [record("c", 0, "bare", [5.0, 6.0, 4.0], [0, 0, 1]), record("c", 0, "icl_oracle", [3.0, 2.0, 2.0], [1, 1, 1]),
            record("c", 512, "rag", [3.0, 4.0, 2.5], [1, 0, 1]),
            record("c", 512, "fleet_iso", [4.0, 5.0, 3.0], [0, 1, 1], seed=7),
            record("c", 512, "fleet_iso", [5.0, 4.0, 4.0], [1, 1, 0], seed=8)]
    write_records(out / "c.jsonl", recs)
    result = lt.table(out)
    rows = {(r["arm"], r["seed"]): r for r in result["corpora"]["c"]["rows"]}
    assert {("fleet_iso", 7), ("fleet_iso", 8), ("fleet_iso", "mean")} <= rows.keys()
    gap = statistics.mean([2.0, 4.0, 2.0])
    mean_nll = [4.5, 4.5, 3.5]
    pooled = rows[("fleet_iso", "mean")]
    assert pooled["closure"]["value"] == pytest.approx((5.0 - statistics.mean(mean_nll)) / gap)
    assert pooled["accuracy"] == pytest.approx(statistics.mean([0.5, 1.0, 0.5]))
    assert pooled["vs_rag"]["closure"] == pytest.approx(statistics.mean([3.0 - 4.5, 4.0 - 4.5, 2.5 - 3.5]) / gap)
    (cell,) = [m for m in result["mean"] if m["arm"] == "fleet_iso"]
    assert cell["corpora"] == 1 and cell["closure"] == pytest.approx(pooled["closure"]["value"])
    text = lt.markdown(result)
    assert "| 512 | fleet_iso, seed 7 |" in text and "| 512 | fleet_iso, mean of 2 seeds |" in text
    assert "| 512 | rag |" in text


def test_an_arm_on_more_conversations_is_its_own_row_paired_with_the_usual_count(tmp_path):
    """A trained arm rerun on more conversations neither joins the usual count's seed mean nor its
    mean over corpora; it is paired per question with the same arm and seed on the usual count."""
    out = tmp_path / "long"
    base = {**record("c", 512, "fleet_mixed", [4.0, 5.0, 3.0], [0, 1, 1], seed=7), "conversations": lt.CONVERSATIONS}
    more = {**record("c", 512, "fleet_mixed", [3.5, 4.0, 3.0], [1, 1, 1], seed=7), "conversations": 512}
    recs = [record("c", 0, "bare", [5.0, 6.0, 4.0], [0, 0, 1]), record("c", 0, "icl_oracle", [3.0, 2.0, 2.0], [1, 1, 1]),
            record("c", 512, "rag", [3.0, 4.0, 2.5], [1, 0, 1]), base, more]
    write_records(out / "c.jsonl", recs)
    result = lt.table(out)
    rows = {(r["arm"], r["conversations"], r["seed"]): r for r in result["corpora"]["c"]["rows"]}
    assert set(rows) >= {("fleet_mixed", lt.CONVERSATIONS, 7), ("fleet_mixed", 512, 7)}
    assert not any(seed == "mean" for _, _, seed in rows)
    gap = statistics.mean([2.0, 4.0, 2.0])
    diff = rows[("fleet_mixed", 512, 7)]["vs_base_conversations"]
    assert diff["closure"] == pytest.approx(statistics.mean([0.5, 1.0, 0.0]) / gap)
    assert diff["accuracy"] == pytest.approx(statistics.mean([1, 0, 0]))
    assert "vs_base_conversations" not in rows[("fleet_mixed", lt.CONVERSATIONS, 7)]
    cells = {(m["arm"], m["conversations"]): m for m in result["mean"]}
    assert cells[("fleet_mixed", 512)]["closure"] == pytest.approx((5.0 - statistics.mean([3.5, 4.0, 3.0])) / gap)
    assert cells[("fleet_mixed", lt.CONVERSATIONS)]["corpora"] == 1
    text = lt.markdown(result)
    assert "| 512 | fleet_mixed, 512 conversations |" in text and "| 512 | fleet_mixed |" in text
    assert f"`fleet_mixed`, 512 conversations at 512 against the same arm and seed on {lt.CONVERSATIONS} conversations" in text
