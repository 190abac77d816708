"""The chat-completion request: strict types, OpenAI defaults, and what is rejected.

Wrong-typed fields, empty messages and unsupported features are a 400 naming the field
(`param`), never a silent coercion: `"temperature": "0.5"` is an error, not 0.5. Fields
this server does not use (user, metadata, ...) are ignored as OpenAI clients send them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from server.errors import bad_request
from server.options import ServeConfig

StrictStr = Annotated[str, Field(strict=True)]
StrictInt = Annotated[int, Field(strict=True)]
StrictBool = Annotated[bool, Field(strict=True)]
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: StrictStr
    messages: Annotated[list[Message], Field(min_length=1)]
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    temperature: Annotated[float, Field(strict=True, ge=0.0, le=2.0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(strict=True, gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: Annotated[int, Field(strict=True, ge=1)] = 1
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    logprobs: StrictBool | None = None
    logit_bias: dict | None = None
    tools: list | None = None
    response_format: dict | None = None


@dataclass(frozen=True)
class ChatParams:
    """A validated request, in the engine's terms."""

    model: str
    messages: list[dict]
    max_tokens: int | None  # None: the server default, clamped to the context
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def parse_chat(raw: bytes, config: ServeConfig) -> ChatParams:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON ({exc})", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    if body.get("messages") == []:
        raise bad_request("messages must hold at least one message", param="messages", code="empty_messages")
    try:
        req = ChatRequest.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors()
        err = max(errors, key=lambda e: len(e["loc"]))  # the deepest: the union member that came closest
        param = _param(err["loc"])
        raise bad_request(f"{param}: {err['msg']} (got {_brief(err.get('input'))})", param=param,
                          code="invalid_value") from exc
    _reject_unsupported(req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    which = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if max_tokens is not None and max_tokens > config.max_tokens_cap:
        raise bad_request(f"{which}={max_tokens} is over this server's cap of {config.max_tokens_cap}",
                          param=which, code="max_tokens_over_cap")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > config.max_stop or any(not s for s in stop):
        raise bad_request(f"stop takes at most {config.max_stop} non-empty strings", param="stop")
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": _text(m)} for m in req.messages]
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return ChatParams(req.model, messages, max_tokens, req.temperature, req.top_p, req.seed, stop, req.stream,
                      include_usage)


def _reject_unsupported(req: ChatRequest) -> None:
    if req.n != 1:
        raise bad_request("n > 1 is not supported (one choice per request)", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise bad_request(f"{name} is not supported (send 0 or leave it out)", param=name)
    if req.logprobs:
        raise bad_request("logprobs are not supported", param="logprobs")
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias")
    if req.tools:
        raise bad_request("tools are not supported", param="tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad_request("only response_format type 'text' is supported", param="response_format")


def _text(message: Message) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param(loc: tuple) -> str:
    """The field path of a validation error, without pydantic's union-member tags (`str`, `list[...]`)."""
    parts = [str(part) for part in loc
             if isinstance(part, int) or (part.isidentifier() and part.islower() and part not in _TYPE_TAGS)]
    return ".".join(parts)


def _brief(value: object) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."
