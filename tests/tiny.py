"""Tiny random models and a byte-level chat tokenizer, built in code (no files)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from cartridges.models import LoadedModel, wrap

# ChatML with the same default-system injection as SmolLM2's template, so tests can
# check that no default system prompt reaches a student sequence.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
VOCAB = 260


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>"
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama(dtype: torch.dtype = torch.float32, layers: int = 2, seed: int = 0) -> LoadedModel:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=2048,
        rope_theta=10000.0, tie_word_embeddings=False, pad_token_id=257, eos_token_id=257,
    )
    model = LlamaForCausalLM(cfg).to(dtype)
    return wrap(model, tiny_tokenizer(), "tiny-llama")


def tiny_qwen3(dtype: torch.dtype = torch.float32, layers: int = 2, seed: int = 0) -> LoadedModel:
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=2048,
        rope_theta=10000.0, tie_word_embeddings=True, pad_token_id=257, eos_token_id=257,
    )
    model = Qwen3ForCausalLM(cfg).to(dtype)
    return wrap(model, tiny_tokenizer(), "tiny-qwen3")


TINY = {"llama": tiny_llama, "qwen3": tiny_qwen3}
