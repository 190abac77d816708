"""Chat-template token ids, with no default system prompt ever injected."""

from __future__ import annotations

import re

THINK_SPAN = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    """Token ids of a rendered conversation (thinking disabled where the template has it)."""
    out = tokenizer.apply_chat_template(
        messages,
        tokenize=True,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=False,
    )
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    return [int(t) for t in out]


def system_ids(tokenizer, text: str) -> list[int]:
    """The system turn holding `text` (how a corpus or chunk sits in context)."""
    return chat_ids(tokenizer, [{"role": "system", "content": text}])


def without_system(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    """Ids of `messages` (first one a system turn) with that system turn cut away.

    Rendering with the system turn and then cutting it keeps the template from
    inserting its default system prompt, so the cartridge takes the turn's place.
    """
    if not messages or messages[0]["role"] != "system":
        raise ValueError("without_system needs a conversation that starts with a system turn")
    full = chat_ids(tokenizer, messages, add_generation_prompt)
    head = system_ids(tokenizer, messages[0]["content"])
    if full[: len(head)] != head:
        raise ValueError("the chat template does not render the system turn as a prefix")
    return full[len(head):]


def strip_think(text: str) -> str:
    """Drop template-marked reasoning spans before an answer is supervised."""
    return THINK_SPAN.sub("", text).strip()


def end_of_turn_ids(tokenizer) -> list[int]:
    """Token ids that close an assistant turn (eos plus template end markers)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for marker in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>"):
        if marker in vocab:
            ids.add(int(vocab[marker]))
    return sorted(ids)
