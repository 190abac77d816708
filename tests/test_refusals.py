"""Models whose cache the engine cannot host are refused at load, in one line naming the model and why."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma3nForCausalLM,
    Gemma3nTextConfig,
    MambaConfig,
    MambaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

from cartridges.core.errors import ModelError
from cartridges.core.models import load_model, wrap
from tests.tiny import TINY, tiny_gemma3, tiny_tokenizer


def gemma3n() -> torch.nn.Module:
    """Gemma 3n's last layers reuse the K/V of earlier ones (cross-layer shared KV)."""
    return Gemma3nForCausalLM(Gemma3nTextConfig(
        vocab_size=260, vocab_size_per_layer_input=260, hidden_size=32, hidden_size_per_layer_input=8,
        intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_kv_shared_layers=2, sliding_window=5, laurel_rank=4, altup_num_inputs=2,
        activation_sparsity_pattern=[0.0] * 4, layer_types=["sliding_attention", "full_attention"] * 2,
    ))


def mamba() -> torch.nn.Module:
    """A state-space model: a recurrent state, no per-token K/V rows."""
    return MambaForCausalLM(MambaConfig(vocab_size=260, hidden_size=32, num_hidden_layers=2, state_size=4, expand=2))


def t5() -> torch.nn.Module:
    return T5ForConditionalGeneration(T5Config(vocab_size=260, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2))


def bidirectional_gemma3() -> torch.nn.Module:
    model = tiny_gemma3().model
    model.config.use_bidirectional_attention = True
    return model


def chunked_llama() -> torch.nn.Module:
    model = TINY["llama"]().model
    model.config.layer_types = ["chunked_attention", "full_attention"]
    return model


@pytest.mark.parametrize(("build", "reason"), [
    (gemma3n, r"shares KV across layers \(2 layers\)"),
    (mamba, "layer types linear_attention"),
    (t5, "an encoder-decoder model"),
    (bidirectional_gemma3, "bidirectional"),
    (chunked_llama, "layer types chunked_attention"),
])
def test_unhostable_models_are_refused_in_one_line(build, reason):
    model = build()
    with pytest.raises(ModelError, match=reason) as err:
        wrap(model, tiny_tokenizer(), "probe-model")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"probe-model ({type(model).__name__}): cannot host cartridges: ")


def test_the_cache_probe_catches_what_the_config_does_not_say(monkeypatch):
    """Mamba with its layer kinds hidden: running two tokens shows no per-layer K/V rows."""
    model = mamba()
    monkeypatch.setattr(MambaConfig, "layer_types", property(lambda self: None))
    with pytest.raises(ModelError, match="non-standard cache|does not fill a standard transformers cache") as err:
        wrap(model, tiny_tokenizer(), "probe-model")
    assert "\n" not in str(err.value)


def test_an_encoder_decoder_directory_is_refused_before_its_weights_load(tmp_path):
    t5().save_pretrained(tmp_path / "t5")
    with pytest.raises(ModelError, match="encoder-decoder") as err:
        load_model(str(tmp_path / "t5"), "cpu")
    assert str(err.value).startswith(f"{tmp_path / 't5'} (t5): cannot host cartridges: ")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("family", sorted(TINY))
def test_every_tested_family_is_hosted(family):
    assert TINY[family]().model.training is False  # wrap ran the checks and froze it
