"""Training health check: each failure mode flags a run; a healthy curve passes."""

from __future__ import annotations

import json

import pytest

from cartridges.core.health import health_fields, training_health

GOOD = [2.0, 1.9, 1.8, 1.7, 1.6, 1.5, 1.5, 1.4, 1.4, 1.3]


def test_a_healthy_run_passes():
    assert training_health(GOOD, 1.20, 1.15) is None
    assert health_fields(GOOD, 1.20, 1.15) == {"health": "ok", "health_reason": None}


@pytest.mark.parametrize(("losses", "before", "after", "words"), [
    (GOOD, 1.20, 1.195, "did not fall clearly"),       # -0.4%: below the 1% bar
    (GOOD, 1.20, 1.30, "did not fall clearly"),        # rose
    (GOOD[:5] + [float("nan")], 1.2, 1.1, "not finite"),
    (GOOD, 1.20, float("inf"), "not finite"),
    (GOOD[::-1] + [2.6] * 3, 1.20, 1.10, "diverged"),   # ends far above where it began
])
def test_each_failure_mode_is_flagged_with_its_reason(losses, before, after, words):
    reason = training_health(losses, before, after)
    assert reason is not None and words in reason
    assert health_fields(losses, before, after)["health"] == "failed"


def test_no_heldout_conversations_checks_the_curve_only():
    assert training_health(GOOD, None, None) is None
    assert "diverged" in training_health([1.0] * 5 + [2.0] * 5, None, None)


def test_a_failed_run_is_recorded_failed_and_train_exits_3(tmp_path, tiny_model_dir, capsys):
    from cli.main import main
    from storage import Store

    corpus = tmp_path / "c.md"
    corpus.write_text("Prefix caches hold keys and values. A cartridge is trained offline. " * 20)
    store = tmp_path / "store"
    # Four steps on a random tiny model cannot move the held-out loss by 1%.
    code = main(["train", "--model", str(tiny_model_dir), "--corpus", str(corpus), "--store", str(store),
                 "--preset", "smoke", "--no-filter", "--min-heldout-drop", "0.01", "--no-prefect", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert code == 3 and summary["health"] == "failed" and "did not fall clearly" in summary["health_reason"]
    assert any(line.startswith("HEALTH CHECK FAILED") for line in out)
    assert [r["status"] for r in Store(store, read_only=True).catalog.runs()] == ["failed"]
    assert (store / "train").is_dir() and list(store.glob("train/*/cartridge.safetensors"))
