"""Chat-template token ids, with no default system prompt ever injected.

A document sits in context as a system turn. Templates without a system role (Gemma
folds a system message into the first user turn) hold it at the head of that user
turn instead; either way the document's tokens are one head of the rendered
conversation, and that head is what a cartridge replaces.
"""

from __future__ import annotations

import re

from cartridges.core.errors import ModelError

THINK_SPAN = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
# Stand-ins that no template writes on its own, to find where a message's text lands.
_SYSTEM_PROBE = "cartridge-system-probe"
_USER_PROBE = "cartridge-user-probe"


def require_template(tokenizer) -> None:
    """Self-study, training, ask and serve all render conversations; a base model cannot."""
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError(
            "the model has no chat template (a base model): self-study, training, ask and serve render "
            "conversations with one; a base model supports `cartridges model` and `cartridges equiv` only"
        )


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    """Token ids of a rendered conversation (thinking disabled where the template has it)."""
    require_template(tokenizer)
    out = tokenizer.apply_chat_template(
        messages,
        tokenize=True,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=False,
    )
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    return [int(t) for t in out]


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    require_template(tokenizer)
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, enable_thinking=False
    )


def system_ids(tokenizer, text: str) -> list[int]:
    """The tokens holding `text` as context (how a corpus or chunk sits in context).

    The system turn where the template has one; otherwise the head of the first user
    turn up to where the user's own words begin (Gemma: `<bos><start_of_turn>user\n`,
    the text, a blank line).
    """
    turn = [{"role": "system", "content": text}]
    if _SYSTEM_PROBE in render(tokenizer, [{"role": "system", "content": _SYSTEM_PROBE}]):
        return chat_ids(tokenizer, turn)
    folded = render(tokenizer, [*turn, {"role": "user", "content": _USER_PROBE}])
    at = folded.find(_USER_PROBE)
    if at < 0 or text not in folded[:at]:
        raise ValueError("the chat template renders a system message neither as a turn nor ahead of the first user turn")
    return [int(t) for t in tokenizer(folded[:at], add_special_tokens=False)["input_ids"]]


def without_system(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    """Ids of `messages` (first one a system turn) with that system turn cut away.

    Rendering with the system turn and then cutting it keeps the template from
    inserting its default system prompt, so the cartridge takes the turn's place;
    where the template folds the system text into the first user turn, the cut takes
    that turn's head with it and the user's words follow the cartridge directly.
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
