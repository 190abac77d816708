"""Models of real shapes with random weights, built from configs shipped in the repository.

Speed does not depend on the weights' values, so the GPU check builds each model from
its `config.json` under `configs/` (the default model SmolLM2-135M, Qwen3-0.6B and
Llama-3.2-1B, as published), initializes it at random directly on the device and
feeds it token ids: no weights, no tokenizer, nothing downloaded. `tiny=True` keeps
each architecture (GQA, q/k-norm, tied embeddings, RoPE scaling) at toy sizes, for
the CPU dry run.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from cartridges.core.models import LoadedModel, wrap  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
MODELS = ("smollm2-135m", "qwen3-0.6b", "llama-3.2-1b")

# Toy sizes for the dry run: each config keeps its own kinds of layers and options.
TINY_FIELDS = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                   head_dim=16, vocab_size=512)


class IdTokenizer:
    """Stands in for a tokenizer where only token ids matter: any text becomes one fixed
    id sequence (the equivalence gate reads its corpus through `lm.tokenizer`)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = list(ids)

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": list(self.ids)}


def random_ids(n: int, vocab: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


def load_config(name: str, tiny: bool = False):
    config = AutoConfig.from_pretrained(str(CONFIGS / name), local_files_only=True)
    if tiny:
        groups = config.num_attention_heads // config.num_key_value_heads
        for key, value in TINY_FIELDS.items():
            setattr(config, key, value)
        config.num_key_value_heads = max(1, TINY_FIELDS["num_attention_heads"] // groups)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if isinstance(getattr(config, key, None), int) and getattr(config, key) >= config.vocab_size:
                setattr(config, key, config.vocab_size - 1)
    return config


def build(name: str, device: torch.device, dtype: torch.dtype, tiny: bool = False, seed: int = 0) -> LoadedModel:
    """A frozen model of `name`'s shape with random weights, created on `device` in `dtype`."""
    config = load_config(name, tiny)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to(device=device, dtype=dtype)
    return wrap(model, IdTokenizer([]), name)


def parameters(lm: LoadedModel) -> int:
    return sum(p.numel() for p in lm.model.parameters())
