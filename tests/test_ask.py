"""`ask`: the in-context answer of a corpus longer than the window is cut to fit, and says so."""

from __future__ import annotations

from cartridges.evaluation.ask import ask_arms


def test_a_corpus_longer_than_the_window_is_cut_to_fit_and_the_cut_is_reported(tmp_path, tiny_model_dir):
    corpus = tmp_path / "long.md"
    corpus.write_text("The apple code is 1001. " * 200)  # byte-level tokens: about 4,800, the window is 2,048
    arms = {a["arm"]: a for a in ask_arms(str(tiny_model_dir), "cpu", [], "What is the apple code?", [str(corpus)],
                                          max_new=4, dtype="float32")}
    icl = arms["in-context"]
    assert icl["corpus_tokens_cut"] > 2000
    assert icl["kv_rows"] + 4 <= 2048  # question and answer fit behind the cut corpus
    assert icl["ttft_s"] > 0 and "corpus_tokens_cut" not in arms["bare"]
    short = tmp_path / "short.md"
    short.write_text("The apple code is 1001.")
    small = {a["arm"]: a for a in ask_arms(str(tiny_model_dir), "cpu", [], "What is the apple code?", [str(short)],
                                           max_new=4, dtype="float32")}
    assert small["in-context"]["corpus_tokens_cut"] == 0
