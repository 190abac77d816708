"""Each run leaves a markdown summary and a loss-curve PNG beside its artifacts, and its row in `runs`."""

from __future__ import annotations

from jobs.pipeline import run_pipeline
from storage import Store, query
from tests.test_pipeline import CORPUS, smoke
from tests.tiny import tiny_llama

PNG = b"\x89PNG\r\n\x1a\n"


def test_a_rerun_reports_every_stage_skipped_as_unchanged_with_the_loss_curve(tmp_path):
    corpus = tmp_path / "corpus.md"
    corpus.write_text(CORPUS)
    store, lm = Store(tmp_path / "s"), tiny_llama()
    first = run_pipeline(store, lm, [corpus], smoke())
    second = run_pipeline(store, lm, [corpus], smoke())
    one = (tmp_path / "s" / "runs" / first["run_id"] / "summary.md").read_text()
    two = (tmp_path / "s" / "runs" / second["run_id"] / "summary.md").read_text()
    assert one.count("| ran |") == 6 and "skipped (unchanged)" not in one
    assert two.count("| skipped (unchanged) |") == 6 and "| ran |" not in two
    assert f"Loss curve: `{first['loss_png']}`" in one
    assert (tmp_path / "s" / "runs" / first["run_id"] / "loss.png").read_bytes()[:8] == PNG
    _, rows = query(store.root, "SELECT run_id, summary->>'loss_png' FROM runs ORDER BY started_at")
    assert rows == [(first["run_id"], first["loss_png"]), (second["run_id"], second["loss_png"])]
