"""The equivalence gate through the CLI, on a tiny saved model and on the default model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cartridges.evaluation.equiv import equivalence
from cli.main import main

CORPUS = Path(__file__).resolve().parent.parent / "docs" / "corpus" / "deflate.md"


def test_equiv_cli_passes_and_prints_json_last(tiny_model_dir, tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("A small corpus about prefix caches and their rows. " * 10)
    code = main(["equiv", "--model", str(tiny_model_dir), "--corpus", str(corpus), "--p", "64", "--suffix-max", "32", "--parts", "2", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert code == 0 and result["pass"] is True
    assert result["n"] == 32 and result["greedy_agree"] == 32 and result["max_abs_dlogit"] <= 1e-4
    assert any(line.startswith("PASS") for line in out)


def test_equiv_cli_too_short_corpus_says_what_it_needs(tiny_model_dir, tmp_path, capsys):
    corpus = tmp_path / "short.txt"
    corpus.write_text("x" * 100)  # byte-level tokenizer: 100 tokens
    code = main(["equiv", "--model", str(tiny_model_dir), "--corpus", str(corpus), "--p", "64", "--parts", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert "has 100 tokens" in err and "needs at least 130" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("bad", ["missing", "binary", "latin1", "empty"])
def test_equiv_cli_bad_corpus_is_one_clear_line(tiny_model_dir, tmp_path, capsys, bad):
    path = tmp_path / f"{bad}.txt"
    if bad == "binary":
        path.write_bytes(b"\x00\x01\x02" * 50)
    elif bad == "latin1":
        path.write_bytes("caf\xe9 cr\xe8me".encode("latin-1") * 40)
    elif bad == "empty":
        path.write_text("  \n")
    code = main(["equiv", "--model", str(tiny_model_dir), "--corpus", str(path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and str(path) in err and len(err.splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("parts", [1, 2])
def test_default_model_gate_on_a_real_document(default_lm, parts):
    r = equivalence(default_lm, CORPUS.read_text(), p=256, suffix_max=128, parts=parts)
    assert r["n"] == 128
    assert r["greedy_agree"] == 128
    assert r["max_abs_dlogit"] <= 1e-3
    assert r["pass"]
