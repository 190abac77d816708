"""The quality-curve driver: resume, aggregation, fit and plot, with an injected runner (no model)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from cartridges.evaluation.scoring import bootstrap_ci
from experiments import curve


def _train_json(n: int) -> dict:
    return {"conversations": n - 10, "planned_conversations": n, "health": "ok", "health_reason": None,
            "heldout_loss_before": 1.25, "heldout_loss_after": 1.2, "steps": n // 4, "losses": [1.0] * 3,
            "cartridge": "/x/cartridge.safetensors", "seconds": 12.0, "skipped": []}


def _eval_json(nll_closure: float | None, acc_closure: float | None = 0.25) -> dict:
    arm = {"accuracy": 0.5, "accuracy_ci": [0.3, 0.7], "gold_nll": 3.0, "gold_nll_ci": [2.5, 3.5],
           "kv_rows": 10, "ttft_s": 0.1}
    return {"questions": 36, "arms": {"bare": arm, "icl": {**arm, "accuracy": 0.75}, "cartridge": arm,
                                      "full_kv": arm},
            "icl_gap_closure": {"value": acc_closure, "reason": None, "metric": "accuracy", "ci": [-0.1, 0.6],
                                "arm": "cartridge"},
            "icl_gap_closure_nll": {"value": nll_closure, "reason": None, "metric": "gold_nll", "ci": [0.0, 0.4],
                                    "ci_left_out": 3, "arm": "cartridge"}}


class FakeRunner:
    """Answers `train` and `eval` argv with canned JSON and records which points it was asked for."""

    def __init__(self, train_code: int = 0):
        self.calls: list[list[str]] = []
        self.train_code = train_code

    def __call__(self, argv: list[str]) -> tuple[int, str]:
        self.calls.append(argv)
        if "train" in argv:
            n = int(argv[argv.index("--conversations") + 1])
            return self.train_code, "step    0  loss 1.0\nsummary line\n" + json.dumps(_train_json(n)) + "\n"
        return 0, "| arm | ... |\n" + json.dumps(_eval_json(0.2)) + "\n"

    def points(self, command: str) -> list[tuple[str, str]]:
        out = []
        for argv in self.calls:
            if command in argv:
                corpus = argv[argv.index("--corpus") + 1]
                out.append((corpus.rsplit("/", 1)[-1], argv[argv.index("--seed") + 1] if "--seed" in argv else ""))
        return out


def test_run_skips_finished_points_and_runs_the_rest_in_order_of_n(tmp_path):
    out, store = tmp_path / "curve.jsonl", tmp_path / "store"
    finished = curve.make_record("raft", 7, 8, "bfloat16", "float32", [], _train_json(8), _eval_json(0.1), 1.0, 1.0,
                                 store / "raft-s7-n8")
    curve.append_record(out, finished)
    runner = FakeRunner()
    summary = curve.run_curve(["raft", "panama"], [7], [16, 8], "bfloat16", out, store, runner=runner)
    assert summary["skipped"] == ["raft seed 7 n 8"]
    assert summary["ran"] == ["panama seed 7 n 8", "raft seed 7 n 16", "panama seed 7 n 16"]
    assert summary["failed"] == []
    trains = [a for a in runner.calls if "train" in a]
    assert [a[a.index("--conversations") + 1] for a in trains] == ["8", "16", "16"]
    assert all(a[a.index("--dtype") + 1] == "bfloat16" and a[-1] == "--json" for a in trains)
    evals = [a for a in runner.calls if "eval" in a]
    assert len(evals) == 3 and all("--no-peers" in a and a[a.index("--dtype") + 1] == "float32" for a in evals)
    assert evals[0][evals[0].index("--corpus") + 1].endswith("docs/eval/panama.md")
    records = curve.read_records(out)
    assert [(r["doc"], r["conversations_planned"]) for r in records] == [
        ("raft", 8), ("panama", 8), ("raft", 16), ("panama", 16)]
    r = records[-1]
    assert r["conversations_used"] == 6 and r["arms"]["icl"]["accuracy"] == 0.75 and "full_kv" not in r["arms"]
    assert r["icl_gap_closure_nll"] == {"value": 0.2, "ci": [0.0, 0.4], "reason": None, "ci_left_out": 3}
    assert r["heldout_change"] == pytest.approx(-0.04)
    assert r["train"]["steps"] == 4

    again = FakeRunner()
    summary = curve.run_curve(["raft", "panama"], [7], [16, 8], "bfloat16", out, store, runner=again)
    assert summary["ran"] == [] and len(summary["skipped"]) == 4 and again.calls == []

    # other extra arguments are another measurement, with its own store directory
    other = FakeRunner()
    summary = curve.run_curve(["raft"], [7], [8], "bfloat16", out, store, extra=["--p", "512"], runner=other)
    assert summary["ran"] == ["raft seed 7 n 8"]
    train_argv = other.calls[0]
    assert train_argv[-3:] == ["--p", "512", "--json"]
    assert train_argv[train_argv.index("--store") + 1] != str(store / "raft-s7-n8")
    assert curve.run_curve(["raft"], [7], [8], "bfloat16", out, store, extra=["--p", "512"],
                           runner=FakeRunner())["skipped"] == ["raft seed 7 n 8"]
    # so are other eval arguments; they reach the eval command only
    other = FakeRunner()
    summary = curve.run_curve(["raft"], [7], [8], "bfloat16", out, store, extra_eval=["--max-new", "8"], runner=other)
    assert summary["ran"] == ["raft seed 7 n 8"]
    assert "--max-new" not in other.calls[0] and other.calls[1][-3:] == ["--max-new", "8", "--json"]
    # run arguments reach the train command only and leave the point's key alone
    how = FakeRunner()
    summary = curve.run_curve(["raft"], [7], [32], "bfloat16", out, store, run_args=["--save-every", "50"], runner=how)
    assert how.calls[0][-3:] == ["--save-every", "50", "--json"] and "--save-every" not in how.calls[1]
    assert curve.run_curve(["raft"], [7], [32], "bfloat16", out, store, runner=FakeRunner())["skipped"] == [
        "raft seed 7 n 32"]


def test_a_lever_point_can_start_from_a_copy_of_the_default_points_store(tmp_path):
    out, store = tmp_path / "curve.jsonl", tmp_path / "store"
    default = store / "raft-s7-n8"
    (default / "synthesize").mkdir(parents=True)
    (default / "catalog.duckdb").write_bytes(b"catalog")
    (default / "synthesize" / "part-00000.parquet").write_bytes(b"shard")
    (default / "cartridge.safetensors").write_bytes(b"default cartridge")
    runner = FakeRunner()
    curve.run_curve(["raft"], [7], [8], "bfloat16", out, store, extra=["--schedule", "cosine"], runner=runner,
                    reuse_default=True)
    lever = Path(runner.calls[0][runner.calls[0].index("--store") + 1])
    assert lever != default and lever.parent == store
    assert (lever / "synthesize" / "part-00000.parquet").read_bytes() == b"shard"
    assert (lever / "catalog.duckdb").read_bytes() == b"catalog"
    assert not (lever / "cartridge.safetensors").exists()  # the lever trains its own
    # a store the lever already has (a resumed lever) is kept as it is
    (lever / "catalog.duckdb").write_bytes(b"lever's own")
    assert not curve.seed_store(lever, default)
    assert (lever / "catalog.duckdb").read_bytes() == b"lever's own"
    # without the flag, or without a default store, a lever starts empty
    other = FakeRunner()
    curve.run_curve(["raft"], [7], [8], "bfloat16", out, store, extra=["--lr", "1e-2"], runner=other)
    assert not Path(other.calls[0][other.calls[0].index("--store") + 1]).exists()
    assert not curve.seed_store(tmp_path / "new", tmp_path / "missing")


def test_a_point_on_more_conversations_starts_from_the_largest_smaller_points_store(tmp_path):
    """Synthesis takes over a smaller point's conversations (the first of its plan), so a larger
    point starts from a copy of the largest smaller store of the same dtype and arguments."""
    out, store = tmp_path / "curve.jsonl", tmp_path / "store"
    for n, extra in ((4, ["--p", "256"]), (8, ["--p", "256"]), (12, ["--p", "512"]), (32, ["--p", "256"])):
        directory = curve.point_dir(store, "raft", 7, n, "float32", extra)
        directory.mkdir(parents=True)
        (directory / "catalog.duckdb").write_text(f"n{n} {extra[1]}")
    runner = FakeRunner()
    curve.run_curve(["raft"], [7], [16], "float32", out, store, extra=["--p", "256"], runner=runner)
    point = Path(runner.calls[0][runner.calls[0].index("--store") + 1])
    assert point == curve.point_dir(store, "raft", 7, 16, "float32", ["--p", "256"])
    assert (point / "catalog.duckdb").read_text() == "n8 256"  # not n4, nor n12's other p, nor n32 above
    (record,) = curve.read_records(out)
    assert record["store_seeded_from"] == str(curve.point_dir(store, "raft", 7, 8, "float32", ["--p", "256"]))
    assert curve.smaller_point(store, "raft", 7, 4, "float32", ["--p", "256"]) is None
    assert curve.smaller_point(store, "raft", 7, 16, "bfloat16", ["--p", "256"]) is None


def test_a_failed_train_is_not_recorded_and_a_cut_line_is_survived(tmp_path):
    out = tmp_path / "curve.jsonl"
    out.write_text('{"status": "done", "doc": "raf')  # a write cut by a kill
    summary = curve.run_curve(["raft"], [7], [8], "bfloat16", out, tmp_path / "s", runner=FakeRunner(train_code=2))
    assert summary["ran"] == [] and summary["failed"][0]["stage"] == "train"
    assert curve.read_records(out) == []
    # exit 3 (failed health check) keeps the cartridge: the point is evaluated and recorded
    summary = curve.run_curve(["raft"], [7], [8], "bfloat16", out, tmp_path / "s", runner=FakeRunner(train_code=3))
    assert summary["ran"] == ["raft seed 7 n 8"]
    assert [r["doc"] for r in curve.read_records(out)] == ["raft"]
    assert out.read_text().splitlines()[0] == '{"status": "done", "doc": "raf'


def _synthetic(doc: str, seed: int, n: int, nll: float | None, acc: float | None, cart: float = 0.5) -> dict:
    ev = _eval_json(nll, acc)
    ev["arms"]["cartridge"] = {**ev["arms"]["cartridge"], "accuracy": cart}
    return curve.make_record(doc, seed, n, "bfloat16", "float32", [], _train_json(n), ev, 60.0 * n / 100, 30.0,
                             curve.Path("/s"))


def _with_questions(doc: str, seed: int, nll: dict[str, list[float]],
                    correct: dict[str, list[float]] | None = None) -> dict:
    """A point whose record kept per-question gold NLLs and, if given, correctness (arm -> one
    value per question line)."""
    r = _synthetic(doc, seed, 30, None, None)
    r["minutes"] = 30
    for key, values in (("gold_nll_by_line", nll), ("correct_by_line", correct)):
        r[key] = {str(i): {arm: v[i] for arm, v in values.items()} for i in range(len(values["bare"]))} \
            if values else None
    return r


def test_a_mean_over_points_resamples_each_documents_questions():
    from cartridges.evaluation.scoring import closure_ci

    rng = __import__("numpy").random.default_rng(3)
    bare = list(rng.uniform(4, 6, 40))
    raft = {"bare": bare, "icl": [b - rng.uniform(0.5, 2.5) for b in bare],
            "cartridge": [b - rng.uniform(-0.5, 1.5) for b in bare]}
    one = _with_questions("raft", 7, raft)
    # one point: the eval's own closure interval over the same questions (lower NLL is better)
    expected, _ = closure_ci(*([-x for x in raft[arm]] for arm in ("cartridge", "bare", "icl")), min_gap=0.0)
    assert curve.questions_ci([one]) == pytest.approx(expected)  # the same draw through the same arithmetic
    # a second seed answering the same questions alike is drawn with the same questions: no narrower
    assert curve.questions_ci([one, _with_questions("raft", 8, raft)]) == pytest.approx(curve.questions_ci([one]))
    # aggregate uses it for the NLL closure and says so; a point with no per-question NLLs falls back to points
    row, = curve.aggregate([one, _with_questions("raft", 8, raft)])
    assert row["nll_closure_ci_over"] == "questions" and row["nll_closure_ci"] == curve.questions_ci([one])
    bare_point = {**one, "seed": 9, "gold_nll_by_line": None}
    row, = curve.aggregate([one, bare_point])
    assert row["nll_closure_ci_over"] == "points" and curve.questions_ci([one, bare_point]) is None


def test_a_mean_accuracy_closure_resamples_questions_where_points_kept_correctness():
    from cartridges.evaluation.scoring import closure_ci

    rng = __import__("numpy").random.default_rng(5)
    bare = rng.uniform(4, 6, 40)
    nll = {"bare": list(bare), "icl": list(bare - rng.uniform(0.5, 2.5, 40)), "cartridge": list(bare - 0.5)}
    correct = {"bare": [float(x < 0.3) for x in rng.uniform(size=40)],
               "icl": [float(x < 0.7) for x in rng.uniform(size=40)],
               "cartridge": [float(x < 0.45) for x in rng.uniform(size=40)]}
    one = _with_questions("raft", 7, nll, correct)
    # one point: the eval's own accuracy-closure interval, ICL ahead by at least two questions
    expected, _ = closure_ci(correct["cartridge"], correct["bare"], correct["icl"], min_gap=2 / 40)
    assert curve.questions_ci([one], "correct") == pytest.approx(expected)
    row, = curve.aggregate([one, _with_questions("raft", 8, nll, correct)])
    assert row["acc_closure_ci_over"] == "questions" and row["acc_closure_ci"] == pytest.approx(expected)
    # a point that kept no correctness: accuracy falls back to points, and the table marks it
    row, = curve.aggregate([one, _with_questions("raft", 8, nll)])
    assert row["acc_closure_ci_over"] == "points" and row["nll_closure_ci_over"] == "questions"
    # ICL no better than bare on every draw: no closure, so no interval over questions
    flat = _with_questions("raft", 7, nll, {**correct, "icl": correct["bare"]})
    assert curve.questions_ci([flat], "correct") is None


def test_aggregate_and_fit_match_a_hand_computation():
    records = [_synthetic("raft", 7, 100, 0.0, 0.1), _synthetic("panama", 7, 100, 0.2, None),
               _synthetic("raft", 7, 1000, 0.2, 0.3, cart=0.75), _synthetic("panama", 7, 1000, 0.4, 0.5, cart=0.25)]
    rows = curve.aggregate(records)
    assert [r["conversations"] for r in rows] == [100, 1000]
    r100, r1000 = rows
    assert r100["points"] == 2 and r100["nll_closure"] == pytest.approx(0.1)
    assert r100["acc_closure"] == pytest.approx(0.1) and r100["acc_closure_points"] == 1  # None left out
    assert r100["acc_closure_ci"] is None  # one defined point: no interval
    assert r1000["nll_closure"] == pytest.approx(0.3) and r1000["acc_closure"] == pytest.approx(0.4)
    assert r1000["cartridge_accuracy"] == pytest.approx(0.5) and r1000["icl_accuracy"] == pytest.approx(0.75)
    assert r100["train_wall_min"] == pytest.approx(1.0) and r1000["train_wall_min"] == pytest.approx(10.0)
    # two points a and b: the resampled means are a, (a+b)/2, b with weights 1/4, 1/2, 1/4,
    # so the 2.5th and 97.5th percentiles of 2,000 resamples are a and b
    assert r1000["nll_closure_ci"] == pytest.approx((0.2, 0.4))
    assert r1000["cartridge_accuracy_ci"] == pytest.approx((0.25, 0.75))
    # the eval's own interval (scoring.bootstrap_ci), resampling points instead of questions
    assert r1000["nll_closure_ci"] == bootstrap_ci([0.2, 0.4])

    f = curve.fit(rows)
    # means 0.1 at log10 n = 2 and 0.3 at 3: slope 0.2 per decade, intercept -0.3, 0.5 at 10^4
    assert f["slope_per_decade"] == pytest.approx(0.2) and f["intercept"] == pytest.approx(-0.3)
    assert f["n_at_target"] == pytest.approx(1e4) and f["extrapolated"] is True

    three = curve.fit([{"conversations": 10, "nll_closure": 0.0}, {"conversations": 100, "nll_closure": 0.3},
                       {"conversations": 1000, "nll_closure": 0.3}])
    # x = 1, 2, 3; y = 0, .3, .3: slope = sum((x-2)(y-.2)) / 2 = (.2 + .1) / 2 = .15; intercept = .2 - .3 = -.1
    assert three["slope_per_decade"] == pytest.approx(0.15) and three["intercept"] == pytest.approx(-0.1)
    assert three["n_at_target"] == pytest.approx(10 ** 4)
    flat = curve.fit([{"conversations": 10, "nll_closure": 0.2}, {"conversations": 100, "nll_closure": 0.1}])
    assert flat["n_at_target"] is None and flat["reason"]
    assert curve.fit(rows[:1])["slope_per_decade"] is None

    text = curve.markdown(records, rows, f)
    assert "| 0.10 [1 defined] |" in text.split("\n")[2]  # one defined accuracy point: no interval
    assert "10,000 conversations" in text
    assert "(resumed)" not in text
    assert text.count("| (default) |") == len(records)
    records[0]["train"]["skipped"] = ["ingest", "chunks", "synthesize"]
    assert curve.markdown(records, rows, f).count("(resumed)") == 1


def test_plot_writes_a_png_and_the_cli_prints_the_fit(tmp_path, capsys):
    out, png = tmp_path / "curve.jsonl", tmp_path / "plots" / "curve.png"
    for rec in (_synthetic("raft", 7, 100, 0.0, 0.1), _synthetic("raft", 8, 100, 0.1, 0.1),
                _synthetic("panama", 7, 1000, 0.3, None), _synthetic("raft", 7, 1000, 0.3, 0.2)):
        curve.append_record(out, rec)
    assert curve.main(["plot", "--out", str(out), "--png", str(png), "--markdown", "--json"]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert not png.with_name(png.name + ".tmp").exists()
    stdout = capsys.readouterr().out
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["points"] == 4 and [r["conversations"] for r in summary["rows"]] == [100, 1000]
    assert math.isclose(summary["fit"]["n_at_target"], 10 ** (2 + (0.5 - 0.05) / 0.25))
    assert "| doc | seed |" in stdout and "fit: mean NLL closure" in stdout


def test_plot_selects_one_configuration_by_its_train_args(tmp_path, capsys):
    out, png = tmp_path / "curve.jsonl", tmp_path / "curve.png"
    tuned = _synthetic("raft", 7, 100, 0.5, 0.1)
    tuned["extra_train_args"] = ["--lr", "2e-2"]
    for rec in (_synthetic("raft", 7, 100, 0.0, 0.1), tuned):
        curve.append_record(out, rec)
    assert curve.main(["plot", "--out", str(out), "--png", str(png), "--train-args", "--lr 2e-2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["points"] == 1 and summary["rows"][0]["nll_closure"] == pytest.approx(0.5)
    assert curve.main(["plot", "--out", str(out), "--png", str(png), "--train-args", "", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["points"] == 1 and summary["rows"][0]["nll_closure"] == pytest.approx(0.0)
    assert curve.main(["plot", "--out", str(out), "--png", str(png), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["points"] == 2
    assert curve.select(curve.read_records(out), None, ["panama"]) == []
    assert len(curve.select(curve.read_records(out), None, ["raft"])) == 2
    with pytest.raises(SystemExit, match="train args '--p 512'"):
        curve.main(["plot", "--out", str(out), "--png", str(png), "--train-args", "--p 512"])


def test_a_point_trained_in_two_dtypes_is_chosen_with_dtype_not_counted_twice(tmp_path, capsys):
    out = tmp_path / "levers.jsonl"
    fast = {**_synthetic("raft", 7, 100, 0.5, 0.1), "dtype": "auto"}
    other = {**_synthetic("raft", 8, 100, 0.7, 0.1), "dtype": "auto"}  # another seed: a point of its own
    for rec in (_synthetic("raft", 7, 100, 0.1, 0.1), fast, _synthetic("panama", 7, 100, 0.3, 0.1), other):
        curve.append_record(out, rec)
    with pytest.raises(SystemExit, match="raft seed 7 .* trained in auto and bfloat16; choose one with --dtype"):
        curve.main(["plot", "--out", str(out), "--png", "none.png"])
    assert curve.main(["plot", "--out", str(out), "--png", str(tmp_path / "c.png"), "--dtype", "auto", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["points"] == 2 and summary["rows"][0]["nll_closure"] == pytest.approx(0.6)
    assert curve.main(["plot", "--out", str(out), "--png", str(tmp_path / "c.png"), "--dtype", "bfloat16", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["points"] == 2 and summary["rows"][0]["nll_closure"] == pytest.approx(0.2)
    # one dtype per point is no ambiguity, whatever the other points trained in
    assert [r["doc"] for r in curve.selected([out], None, ["panama"])] == ["panama"]
    assert sorted(r["dtype"] for r in curve.select(curve.read_records(out), None, ["raft"], dtype="auto")) == ["auto"] * 2
    with pytest.raises(SystemExit, match="holds no finished point trained in float16"):
        curve.selected([out], None, dtype="float16")


def test_plot_reads_several_results_files_and_the_later_copy_of_a_point_counts(tmp_path, capsys):
    curve_out, levers_out, png = tmp_path / "curve.jsonl", tmp_path / "levers.jsonl", tmp_path / "c.png"
    curve.append_record(curve_out, _synthetic("raft", 7, 100, 0.1, 0.1))
    curve.append_record(curve_out, _synthetic("raft", 7, 1000, 0.2, 0.1))
    curve.append_record(levers_out, _synthetic("raft", 7, 1000, 0.4, 0.1))  # the same point, measured again
    assert curve.main(["plot", "--out", str(curve_out), str(levers_out), "--png", str(png), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["points"] == 2 and summary["out"] == [str(curve_out), str(levers_out)]
    assert [r["nll_closure"] for r in summary["rows"]] == pytest.approx([0.1, 0.4])


def test_plot_without_results_says_so(tmp_path):
    with pytest.raises(SystemExit, match="no finished point"):
        curve.main(["plot", "--out", str(tmp_path / "none.jsonl"), "--png", str(tmp_path / "c.png")])


def _fake_eval(store: Path, name: str, cartridge: str, gold: dict[str, list[float]]) -> None:
    d = store / "eval-store" / "eval" / name
    d.mkdir(parents=True)
    (d / "result.json").write_text(json.dumps({"cartridges": [cartridge]}))
    rows = [{"arm": arm, "line": i + 1, "gold_nll": v, "correct": v < 5.5}
            for arm, vals in gold.items() for i, v in enumerate(vals)]
    (d / "answers.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_compare_pairs_two_points_question_by_question(tmp_path, capsys):
    out, store = tmp_path / "curve.jsonl", tmp_path / "store"
    bare, icl = [6.0, 5.0, 7.0, 6.0], [4.0, 3.0, 5.0, 4.0]  # gap 2 on every question
    base_cart, other_cart = [5.0, 4.0, 6.0, 5.0], [4.5, 4.0, 5.0, 5.5]  # changes -0.5, 0, -1, +0.5
    records = []
    for i, (args, cart) in enumerate(((["--lr", "2e-3"], base_cart), (["--focus"], other_cart))):
        rec = _synthetic("raft", 7, 250, 0.1, 0.1)
        rec.update(extra_train_args=args, cartridge=f"/c{i}.safetensors", store=str(store / f"p{i}"))
        _fake_eval(store, f"e{i}", rec["cartridge"], {"bare": bare, "icl": icl, "cartridge": cart})
        curve.append_record(out, rec)
        records.append(rec)
    c = curve.compare([out], "raft", 7, 250, ["--lr", "2e-3"], ["--focus"])
    assert c["questions"] == 4 and c["gold_nll_change"] == pytest.approx(-0.25)
    assert c["gap"] == pytest.approx(2.0) and c["closure_change"] == pytest.approx(0.125)
    assert (c["better"], c["worse"]) == (2, 1)
    lo, hi = c["gold_nll_change_ci"]
    assert -1.0 <= lo <= -0.25 <= hi <= 0.5  # inside the range of resampled means
    assert c["closure_change_ci"] == pytest.approx([-hi / 2, -lo / 2])
    assert curve.main(["compare", "--out", str(out), "--doc", "raft", "--seed", "7", "--conversations", "250",
                       "--base", "--lr 2e-3", "--other=--focus", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["gold_nll_change"] == pytest.approx(-0.25)
    with pytest.raises(SystemExit, match="no point raft seed 7 n 500"):
        curve.compare([out], "raft", 7, 500, [], ["--focus"])
    # at equal compute a costlier configuration runs fewer conversations: pair across budgets
    cheap = {**records[1], "conversations_planned": 125, "cartridge": "/c2.safetensors"}
    _fake_eval(store, "e2", cheap["cartridge"], {"bare": bare, "icl": icl, "cartridge": base_cart})
    curve.append_record(out, cheap)
    c = curve.compare([out], "raft", 7, 250, ["--lr", "2e-3"], ["--focus"], other_n=125)
    assert (c["conversations"], c["other_conversations"], c["gold_nll_change"]) == (250, 125, 0.0)
    assert curve.main(["compare", "--out", str(out), "--doc", "raft", "--seed", "7", "--conversations", "250",
                       "--base", "--lr 2e-3", "--other=--focus", "--other-conversations", "125"]) == 0
    assert "n 125 against n 250" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no point raft seed 7 n 500"):
        curve.compare([out], "raft", 7, 250, ["--lr", "2e-3"], ["--focus"], other_n=500)
    # the base point trained again in another dtype: the newest record no longer decides which
    again = {**records[0], "dtype": "float32", "cartridge": "/c3.safetensors"}
    _fake_eval(store, "e3", again["cartridge"], {"bare": bare, "icl": icl, "cartridge": other_cart})
    curve.append_record(out, again)
    with pytest.raises(SystemExit, match="trained in bfloat16 and float32; choose with --dtype"):
        curve.compare([out], "raft", 7, 250, ["--lr", "2e-3"], ["--focus"])
    c = curve.compare([out], "raft", 7, 250, ["--lr", "2e-3"], ["--focus"], dtype="bfloat16")
    assert (c["dtype"], c["other_dtype"], c["gold_nll_change"]) == ("bfloat16", "bfloat16", pytest.approx(-0.25))
    c = curve.compare([out], "raft", 7, 250, ["--lr", "2e-3"], ["--focus"], dtype="float32", other_dtype="bfloat16")
    assert c["gold_nll_change"] == pytest.approx(0.0)  # the float32 base holds the other point's NLLs
    assert curve.main(["compare", "--out", str(out), "--doc", "raft", "--seed", "7", "--conversations", "250",
                       "--base", "--lr 2e-3", "--other=--focus", "--dtype", "float32", "--other-dtype",
                       "bfloat16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["dtype"] == "float32"
    with pytest.raises(SystemExit, match="no point .* trained in float16"):
        curve.compare([out], "raft", 7, 250, ["--lr", "2e-3"], ["--focus"], dtype="float16")


def test_compare_pairs_time_budgeted_twins_across_dtypes_with_seeds_sharing_draws(tmp_path, capsys):
    out = tmp_path / "curve.jsonl"
    bare, icl = [6.0, 5.0, 7.0, 6.0], [4.0, 3.0, 5.0, 4.0]  # gap 2 on every question
    base = [5.0, 4.0, 6.0, 5.0]
    # seed 7's bfloat16 twin is lower by 0.5, 1, 0.5, 1 nats; seed 8's higher by the same: paired
    # per question, the two seeds cancel on every resample of the document's questions
    step = [0.5, 1.0, 0.5, 1.0]
    for seed, sign in ((7, -1), (8, 1)):
        for dtype, cart in (("float32", base), ("auto", [b + sign * d for b, d in zip(base, step, strict=True)])):
            rec = _with_questions("raft", seed, {"bare": bare, "icl": icl, "cartridge": cart})
            rec.update(dtype=dtype, extra_train_args=["--p", "256"], cartridge=f"/{seed}{dtype}.safetensors")
            curve.append_record(out, rec)
    c = curve.compare_docs([out], ["raft"], [7, 8], None, ["--p", "256"], ["--p", "256"], dtype="float32",
                           other_dtype="auto", minutes=30)
    assert [(d["seed"], d["minutes"], d["dtype"], d["other_dtype"]) for d in c["per_doc"]] == [
        (7, 30, "float32", "auto"), (8, 30, "float32", "auto")]
    assert [d["closure_change"] for d in c["per_doc"]] == pytest.approx([0.375, -0.375])  # 0.75 nats of a gap of 2
    assert (c["documents"], c["points"]) == (1, 2)
    assert c["closure_change"] == pytest.approx(0.0) and c["closure_change_ci"] == pytest.approx([0.0, 0.0])
    # drawn apart, the two seeds would not cancel and the interval would open
    apart = curve.pooled([curve.question_changes(*(curve.kept_answers(r) for r in pair))
                          for pair in ([c_ for c_ in curve.read_records(out) if c_["seed"] == s] for s in (7, 8))])
    assert apart["closure_change"] == pytest.approx(0.0) and apart["closure_change_ci"][1] > 0.01
    assert curve.main(["compare", "--out", str(out), "--doc", "raft", "--seeds", "7", "8", "--minutes", "30",
                       "--base=--p 256", "--other=--p 256", "--dtype", "float32", "--other-dtype", "auto",
                       "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("raft seed 7 30 min: auto '--p 256' against float32 '--p 256': gold NLL -0.750")
    assert lines[2].startswith("1 document, 2 points: closure +0.000 (+0.000 to +0.000)")
    assert json.loads(lines[-1])["points"] == 2
    with pytest.raises(SystemExit, match="no point raft seed 7 30 min with train args '--p 256' trained in float16"):
        curve.compare([out], "raft", 7, None, ["--p", "256"], ["--p", "256"], dtype="float16", minutes=30)
    with pytest.raises(SystemExit, match="by conversations or by minutes"):
        curve.compare([out], "raft", 7, 250, ["--p", "256"], ["--p", "256"], minutes=30)
    with pytest.raises(SystemExit, match="time-budgeted twins share their minutes"):
        curve.compare([out], "raft", 7, None, ["--p", "256"], ["--p", "256"], other_n=125, minutes=30)


def test_compare_reads_the_other_point_from_other_results_files(tmp_path, capsys):
    """One configuration measured before and after a change its key does not see: same key, two files."""
    before, after = tmp_path / "before.jsonl", tmp_path / "after.jsonl"
    bare, icl = [6.0, 5.0, 7.0, 6.0], [4.0, 3.0, 5.0, 4.0]  # gap 2 on every question
    for out, cart in ((before, [5.0, 4.0, 6.0, 5.0]), (after, [4.0, 4.0, 5.0, 5.0])):
        rec = _with_questions("raft", 7, {"bare": bare, "icl": icl, "cartridge": cart})
        rec.update(dtype="auto", extra_train_args=["--p", "256"])
        curve.append_record(out, rec)
    c = curve.compare([before], "raft", 7, None, ["--p", "256"], ["--p", "256"], minutes=30, other_outs=[after])
    assert c["gold_nll_change"] == pytest.approx(-0.5) and c["closure_change"] == pytest.approx(0.25)
    assert curve.compare([before], "raft", 7, None, ["--p", "256"], ["--p", "256"],
                         minutes=30)["gold_nll_change"] == 0.0  # without it, the point against itself
    assert curve.main(["compare", "--out", str(before), "--other-out", str(after), "--doc", "raft", "--seed", "7",
                       "--minutes", "30", "--base=--p 256", "--other=--p 256"]) == 0
    assert capsys.readouterr().out.startswith(
        f"raft seed 7 30 min: '--p 256' ({after}) against '--p 256' ({before}): gold NLL -0.500")
    lone = _with_questions("raft", 8, {"bare": bare, "icl": icl, "cartridge": bare})
    lone.update(dtype="auto", extra_train_args=["--p", "256"])
    curve.append_record(before, lone)  # seed 8 measured before only: the missing side is named
    with pytest.raises(SystemExit, match=f"no point raft seed 8 .* in {re.escape(str(after))}$"):
        curve.compare_docs([before], ["raft"], [8], None, ["--p", "256"], ["--p", "256"], minutes=30,
                           other_outs=[after])


def test_records_keep_per_question_nlls_so_compare_needs_no_store(tmp_path):
    import shutil

    out, store = tmp_path / "curve.jsonl", tmp_path / "store"
    bare, icl = [6.0, 5.0, 7.0], [4.0, 3.0, 5.0]
    carts = {"2e-3": [5.0, 4.0, 6.0], "2e-2": [4.0, 4.5, 5.0]}

    class EvalWritingRunner(FakeRunner):
        """Reports the --save path as the cartridge and scores it into the eval store, as the CLI does."""

        def __call__(self, argv: list[str]) -> tuple[int, str]:
            self.calls.append(argv)
            if "train" in argv:
                self.lr = argv[argv.index("--lr") + 1]
                report = {**_train_json(8), "cartridge": argv[argv.index("--save") + 1]}
                return 0, json.dumps(report) + "\n"
            cartridge = argv[argv.index("--cartridge") + 1]
            _fake_eval(store, f"e{len(self.calls)}", cartridge, {"bare": bare, "icl": icl, "cartridge": carts[self.lr]})
            return 0, json.dumps(_eval_json(0.2)) + "\n"

    runner = EvalWritingRunner()
    for lr in carts:
        curve.run_curve(["raft"], [7], [8], "bfloat16", out, store, extra=["--lr", lr], runner=runner)
    records = curve.read_records(out)
    assert [r["gold_nll_by_line"]["3"] for r in records] == [
        {"bare": 7.0, "icl": 5.0, "cartridge": 6.0}, {"bare": 7.0, "icl": 5.0, "cartridge": 5.0}]
    assert [r["correct_by_line"]["3"] for r in records] == [  # correct: the fake eval's gold NLL < 5.5
        {"bare": 0.0, "icl": 1.0, "cartridge": 0.0}, {"bare": 0.0, "icl": 1.0, "cartridge": 1.0}]
    shutil.rmtree(store)  # the committed results file alone must pair the two points
    c = curve.compare([out], "raft", 7, 8, ["--lr", "2e-3"], ["--lr", "2e-2"])
    assert c["questions"] == 3 and c["gold_nll_change"] == pytest.approx((-1.0 + 0.5 - 1.0) / 3)
    assert (c["better"], c["worse"]) == (2, 1)


def test_a_record_without_an_eval_in_the_store_keeps_no_per_question_nlls(tmp_path):
    out, store = tmp_path / "curve.jsonl", tmp_path / "store"
    curve.run_curve(["raft"], [7], [8], "bfloat16", out, store, runner=FakeRunner())
    assert curve.read_records(out)[0]["gold_nll_by_line"] is None


def test_compare_over_documents_averages_each_documents_closure_change(tmp_path, capsys):
    out, store = tmp_path / "curve.jsonl", tmp_path / "store"
    # raft: gap 2, every question 0.5 nats lower (closure +0.25); panama: gap 1, every question
    # 0.1 nats higher (closure -0.1) on three times the questions
    docs = {"raft": ([6.0, 5.0], [4.0, 3.0], [5.0, 4.0], [4.5, 3.5]),
            "panama": ([3.0] * 6, [2.0] * 6, [2.5] * 6, [2.6] * 6)}
    for doc, (bare, icl, base_cart, other_cart) in docs.items():
        for args, cart in (([], base_cart), (["--p", "512"], other_cart)):
            rec = _synthetic(doc, 8, 2000, 0.1, 0.1)
            name = f"{doc}{len(args)}"
            rec.update(extra_train_args=args, cartridge=f"/{name}.safetensors", store=str(store / name))
            _fake_eval(store, name, rec["cartridge"], {"bare": bare, "icl": icl, "cartridge": cart})
            curve.append_record(out, rec)
    c = curve.compare_docs([out], ["raft", "panama"], [8], 2000, [], ["--p", "512"])
    assert [d["closure_change"] for d in c["per_doc"]] == pytest.approx([0.25, -0.1])
    # each document weighs the same whatever its number of questions; pooling the questions
    # would give (2 * 0.25 + 6 * -0.1) / 8 instead
    assert c["documents"] == 2 and c["closure_change"] == pytest.approx(0.075)
    # resampled within each document, where every question changed alike, the interval is the point
    assert c["closure_change_ci"] == pytest.approx([0.075, 0.075])
    assert curve.main(["compare", "--out", str(out), "--doc", "raft", "panama", "--seed", "8",
                       "--conversations", "2000", "--base=", "--other=--p 512", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[2].startswith("2 documents: closure +0.075 (+0.075 to +0.075)")
    assert [d["doc"] for d in json.loads(lines[-1])["per_doc"]] == ["raft", "panama"]
    assert curve.compare([out], "raft", 8, 2000, [], ["--p", "512"]) == c["per_doc"][0]


def test_regions_split_a_points_closure_at_the_first_p_tokens(tmp_path):
    from cartridges.core.chat import system_ids
    from tests.tiny import tiny_llama

    tokenizer = tiny_llama().tokenizer
    text = "# Intro\nshort start.\n## Middle\n" + "filler words. " * 20 + "\n## End\nthe last part.\n"
    # byte-level tokens: the text starts where a one-letter text's ids first differ from an empty one's
    empty, letter = system_ids(tokenizer, ""), system_ids(tokenizer, "x")
    start = next(i for i, (a, b) in enumerate(zip(empty, letter, strict=False)) if a != b)
    wrapped = system_ids(tokenizer, text)
    assert curve.opening_regions(text, tokenizer, len(wrapped)) == {"Intro", "Middle", "End"}
    assert curve.opening_regions(text, tokenizer, start) == set()
    middle = start + text.index("## Middle") + len("## Middle")
    assert curve.opening_regions(text, tokenizer, middle) == {"Intro", "Middle"}
    assert curve.opening_regions(text, tokenizer, middle - 1) == {"Intro"}
    qa = tmp_path / "q.jsonl"
    qa.write_text("\n".join(json.dumps({"region": r}) for r in ("Intro", "End", "End")) + "\n")
    record = {"store": str(tmp_path / "s"), "gold_nll_by_line": {
        "1": {"bare": 6.0, "icl": 4.0, "cartridge": 4.5},
        "2": {"bare": 5.0, "icl": 3.0, "cartridge": 5.0},
        "3": {"bare": 7.0, "icl": 5.0, "cartridge": 6.0}}}
    by = curve.closure_by_region(record, {"Intro"}, qa.read_text().splitlines())
    assert by["opening"] == {"questions": 1, "closure": pytest.approx(0.75)}
    assert by["rest"] == {"questions": 2, "closure": pytest.approx(1.0 / 4.0)}


def test_regions_select_points_by_budget_and_dtype(tmp_path):
    values = {"bare": [6.0, 5.0], "icl": [4.0, 3.0], "cartridge": [5.0, 4.0]}
    budgeted = {**_with_questions("raft", 7, values), "dtype": "auto"}  # sized by 30 minutes
    sized = {**_with_questions("raft", 8, values), "minutes": None}  # sized by conversations, bfloat16
    out = tmp_path / "levers.jsonl"
    for r in (budgeted, sized):
        r["train"]["p"] = 256
        curve.append_record(out, r)
    qa = tmp_path / "q.jsonl"
    qa.write_text("\n".join(json.dumps({"region": "nowhere"}) for _ in range(2)) + "\n")
    rows = curve.regions([out], None, None, qa, dtype="auto", minutes=30)
    assert [(r["seed"], r["dtype"]) for r in rows] == [(7, "auto")]
    assert rows[0]["rest"] == {"questions": 2, "closure": pytest.approx(0.5)}
    assert [r["seed"] for r in curve.regions([out], None, None, qa)] == [8]
    with pytest.raises(SystemExit, match="holds no finished point trained in auto"):
        curve.regions([out], None, None, qa, dtype="auto")  # the budgeted point needs its --minutes


def test_time_budgeted_points_are_keyed_by_minutes_and_kept_apart_from_the_curve(tmp_path, monkeypatch, capsys):
    out, store = tmp_path / "curve.jsonl", tmp_path / "store"

    def runner(argv: list[str]) -> tuple[int, str]:
        calls.append(argv)
        if "train" in argv:
            chosen = 500 if "raft.md" in argv[argv.index("--corpus") + 1] else 600
            return 0, json.dumps({**_train_json(chosen), "budget": {"minutes": 30.0, "conversations": chosen}}) + "\n"
        return 0, json.dumps(_eval_json(0.3)) + "\n"

    calls: list[list[str]] = []
    (store / "raft-s7-n8").mkdir(parents=True)
    (store / "raft-s7-n8" / "catalog.duckdb").write_bytes(b"catalog")  # a smaller point is not copied
    summary = curve.run_curve(["raft", "panama"], [7], [8], "float32", out, store, runner=runner, minutes=30)
    assert summary["ran"] == ["raft seed 7 30 min", "panama seed 7 30 min"]
    trains = [a for a in calls if "train" in a]
    assert all(a[a.index("--minutes") + 1] == "30" and "--conversations" not in a for a in trains)
    raft_store = Path(trains[0][trains[0].index("--store") + 1])
    assert raft_store == curve.point_dir(store, "raft", 7, 0, "float32", [], 30) and raft_store.name.startswith(
        "raft-s7-m30")
    assert not raft_store.exists()  # a fresh store: nothing copied in
    records = curve.read_records(out)
    assert [(r["doc"], r["minutes"], r["conversations_planned"]) for r in records] == [
        ("raft", 30, 500), ("panama", 30, 600)]
    calls.clear()
    assert curve.run_curve(["raft", "panama"], [7], [8], "float32", out, store, runner=runner, minutes=30)[
        "skipped"] == ["raft seed 7 30 min", "panama seed 7 30 min"] and calls == []
    assert curve.select(records, None) == []  # the curve's points are sized by conversations
    rows = curve.aggregate(curve.select(records, None, minutes=30))
    assert len(rows) == 1 and rows[0]["conversations"] == 550 and rows[0]["points"] == 2 and rows[0]["minutes"] == 30
    assert rows[0]["nll_closure"] == pytest.approx(0.3)
    assert "| 550 in 30 min (" in curve.markdown(records, rows, curve.fit(rows))
    # one budget is no curve: `plot --minutes` draws no PNG, so it leaves the committed curve alone
    monkeypatch.chdir(tmp_path)
    assert curve.main(["plot", "--out", str(out), "--minutes", "30", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["png"] is None
    assert not (tmp_path / curve.DEFAULT_PNG).exists()


def test_a_training_lever_on_a_time_budgeted_point_trains_its_twins_conversations_on_its_synthesis(tmp_path):
    from storage import Store

    out, store = tmp_path / "levers.jsonl", tmp_path / "store"
    twin = curve.point_dir(store, "raft", 7, 0, "auto", ["--p", "256"], 30)
    catalog = Store(twin).catalog
    catalog.finish_run(catalog.start_run("cartridge"), "complete", {"budget": {"minutes": 30, "conversations": 96}})
    (twin / "synthesize").mkdir()
    (twin / "synthesize" / "part-00000.parquet").write_bytes(b"shard")
    runner = FakeRunner()
    summary = curve.run_curve(["raft", "panama"], [7], [0], "auto", out, store, extra=["--p", "256", "--frozen", "1"],
                              runner=runner, reuse_default=True, reuse_of=["--p", "256"], minutes=30)
    # the twin's budget chose 96 conversations: the lever trains those, on a copy of the twin's store
    train = runner.calls[0]
    assert train[train.index("--conversations") + 1] == "96" and "--minutes" not in train
    lever = Path(train[train.index("--store") + 1])
    assert lever == curve.point_dir(store, "raft", 7, 0, "auto", ["--p", "256", "--frozen", "1"], 30) != twin
    assert (lever / "synthesize" / "part-00000.parquet").read_bytes() == b"shard"
    # keyed by the twin's minutes, so `compare --minutes 30` pairs the two
    [record] = curve.read_records(out)
    assert (record["minutes"], record["conversations_planned"], record["store_seeded_from"]) == (30, 96, str(twin))
    # panama has no twin: nothing is trained for it, and the run says so
    assert summary["ran"] == ["raft seed 7 30 min"] and [f["point"] for f in summary["failed"]] == [
        "panama seed 7 30 min"]
    assert len(runner.calls) == 2


def _peer_eval(store: Path, name: str, rows: int, values: dict[str, list[float]], doc: str = "raft.md") -> None:
    d = store / "eval" / name
    d.mkdir(parents=True)
    arms = {"bare": {"kv_rows": 20.5}, **{arm: {"kv_rows": rows + 20.5} for arm in values}}  # + the question's rows
    (d / "result.json").write_text(json.dumps({"arms": arms}))
    lines = [{"arm": arm, "line": i, "doc": doc, "gold_nll": v} for arm, vals in values.items() for i, v in enumerate(vals)]
    (d / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_peers_are_paired_with_the_points_at_their_rows(tmp_path, capsys):
    import os

    import numpy as np

    from cartridges.evaluation.scoring import closure_ci

    rng = np.random.default_rng(11)
    bare = rng.uniform(4, 6, 30)
    gap = rng.uniform(0.5, 2.5, 30)
    icl, cart = bare - gap, bare - 0.5 * gap + rng.normal(0, 0.3, 30)
    peers = {"knorm": bare - 0.1 * gap, "snapkv": bare - 0.3 * gap + rng.normal(0, 0.3, 30), "first": cart}
    point = _with_questions("raft", 7, {"bare": list(bare), "icl": list(icl), "cartridge": list(cart)})
    point["train"]["p"] = 256
    store = tmp_path / "eval-store"
    _peer_eval(store, "at-256", 256, {k: list(v) for k, v in peers.items()})
    _peer_eval(store, "panama", 256, {k: [0.0] * 30 for k in peers}, doc="panama.md")  # another document's
    _peer_eval(store, "at-1024", 1024, {k: [0.0] * 30 for k in peers})  # the newest, at another size
    os.utime(store / "eval" / "at-1024" / "result.json", (2e9, 2e9))

    v = curve.versus_peers([point], store)
    by_arm = {r["arm"]: r for r in v["peers"]}
    for arm, values in peers.items():  # the closure by hand: mean gain over mean gap
        assert by_arm[arm]["closure"] == pytest.approx(np.mean(bare - values) / np.mean(gap))
        assert by_arm[arm]["lead"] == pytest.approx(v["cartridge"]["closure"] - by_arm[arm]["closure"])
    # one point: a peer's interval is the eval's own closure interval on its values (the same draw)
    expected, _ = closure_ci(-peers["snapkv"], -bare, -icl, 0.0)
    assert by_arm["snapkv"]["closure_ci"] == pytest.approx(expected)
    assert v["best_peer"] == "first" and by_arm["first"]["lead_ci"] == (0.0, 0.0)  # paired: no spread
    assert by_arm["knorm"]["lead_ci"][0] > 0  # the cartridge clearly ahead of a peer closing 0.1

    with pytest.raises(SystemExit, match="at 512 rows"):
        curve.versus_peers([{**point, "train": {**point["train"], "p": 512}}], store)
    behind = _with_questions("raft", 8, {"bare": list(icl), "icl": list(bare), "cartridge": list(cart)})
    behind["train"]["p"] = 256  # in context behind bare: no gap to close, so no closure to pair
    with pytest.raises(SystemExit, match="closure is undefined"):
        curve.versus_peers([point, behind], store)
    out = tmp_path / "levers.jsonl"
    curve.append_record(out, point)
    assert curve.main(["peers", "--out", str(out), "--eval-store", str(store), "--minutes", "30", "--json"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert json.loads(printed[-1])["best_peer"] == "first" and "(best peer)" in printed[-2]
