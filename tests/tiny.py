"""Tiny random models and a byte-level chat tokenizer, built in code (no files)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from cartridges.core.models import LoadedModel, wrap

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
# Gemma 3's template (google/gemma-3-*-it, tokenizer_config.json): no system role; a
# system message is folded into the first user turn, followed by a blank line.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)
VOCAB = 260
# Shorter than the prefixes the tests use, so sliding-window layers see only part of a cartridge.
WINDOW = 5


def _byte_tokenizer() -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _chat_tokenizer(bos: str, eos: str, markers: list[str], template: str) -> PreTrainedTokenizerFast:
    fast = PreTrainedTokenizerFast(tokenizer_object=_byte_tokenizer(), bos_token=bos, eos_token=eos, pad_token=eos)
    fast.add_special_tokens({"additional_special_tokens": markers})
    fast.chat_template = template
    return fast


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Bytes plus ChatML markers, with SmolLM2's default-system injection."""
    return _chat_tokenizer("<|im_start|>", "<|im_end|>", ["<|im_start|>", "<|im_end|>"], CHAT_TEMPLATE)


def gemma_tokenizer() -> PreTrainedTokenizerFast:
    """Bytes plus Gemma's turn markers (ids 256..259), with Gemma 3's chat template."""
    return _chat_tokenizer("<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>"], GEMMA3_TEMPLATE)


# What every tiny model shares; each family adds or overrides its own fields.
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False, pad_token_id=257,
            eos_token_id=257)


def _tiny(config_cls, model_cls, name: str, dtype: torch.dtype, layers: int, seed: int, tokenizer=None,
          **fields) -> LoadedModel:
    torch.manual_seed(seed)
    kwargs = {k: v for k, v in {**BASE, **fields}.items() if v is not None}  # None: the family's own default
    model = model_cls(config_cls(num_hidden_layers=layers, **kwargs)).to(dtype)
    return wrap(model, tokenizer or tiny_tokenizer(), name)


def tiny_llama(dtype: torch.dtype = torch.float32, layers: int = 2, seed: int = 0) -> LoadedModel:
    return _tiny(LlamaConfig, LlamaForCausalLM, "tiny-llama", dtype, layers, seed, head_dim=8)


def tiny_qwen3(dtype: torch.dtype = torch.float32, layers: int = 2, seed: int = 0) -> LoadedModel:
    return _tiny(Qwen3Config, Qwen3ForCausalLM, "tiny-qwen3", dtype, layers, seed, head_dim=8,
                 tie_word_embeddings=True)


def tiny_gemma3(dtype: torch.dtype = torch.float32, layers: int = 2, seed: int = 0) -> LoadedModel:
    """Gemma 3's text stack: sliding and global layers (different RoPE bases), one KV head,
    q/k-norm, scaled embeddings, (1 + w) norms and final logit soft-capping."""
    lm = _tiny(Gemma3TextConfig, Gemma3ForCausalLM, "tiny-gemma3", dtype, layers, seed, gemma_tokenizer(),
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
               sliding_window=WINDOW, layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
               final_logit_softcapping=30.0, tie_word_embeddings=True, bos_token_id=256, rope_theta=None)
    _perturb_norms(lm.model, seed)
    return lm


def tiny_mistral(dtype: torch.dtype = torch.float32, layers: int = 2, seed: int = 0) -> LoadedModel:
    """Mistral: every layer slides over the last `WINDOW` positions."""
    return _tiny(MistralConfig, MistralForCausalLM, "tiny-mistral", dtype, layers, seed, head_dim=8,
                 sliding_window=WINDOW)


def tiny_phi3(dtype: torch.dtype = torch.float32, layers: int = 2, seed: int = 0) -> LoadedModel:
    """Phi-3: fused qkv and gate/up projections, every layer sliding over `WINDOW` positions."""
    return _tiny(Phi3Config, Phi3ForCausalLM, "tiny-phi3", dtype, layers, seed, sliding_window=WINDOW,
                 original_max_position_embeddings=2048, bos_token_id=256)


def _perturb_norms(model: torch.nn.Module, seed: int) -> None:
    """Gemma initializes its (1 + w) norm weights at zero; random ones make q/k-norm matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=gen, dtype=param.dtype))


TINY = {"llama": tiny_llama, "qwen3": tiny_qwen3, "gemma3": tiny_gemma3, "mistral": tiny_mistral, "phi3": tiny_phi3}
