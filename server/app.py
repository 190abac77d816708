"""HTTP routes: `/v1/chat/completions` (plain and SSE), `/v1/models`, `/health`, `/admin/reload`.

Every error a client can cause is an OpenAI-style JSON body with a 4xx status. Request
handlers never touch the model: they validate, hand the request to the engine, and turn
its token events into text (stop strings are applied here; a request that hits one, or
whose client disconnects, is cancelled so its batch slot frees on the next step).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from cartridges.core.errors import CartridgeError
from cartridges.core.models import LoadedModel
from server.engine import Accepted, Engine, Job
from server.errors import ApiError, internal, too_large, unauthorized
from server.options import ServeConfig
from server.schema import ChatParams, parse_chat
from server.selector import Selector
from server.text import TextStream

DISCONNECT_POLL_S = 0.5


class BodyLimit:
    """Refuse request bodies over `limit` bytes (413) before they are read into memory."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or {}).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await too_large(self.limit).response()(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise too_large(self.limit)
            return message

        return await self.app(scope, counted, send)


def create_app(lm: LoadedModel, selector: Selector, engine: Engine, config: ServeConfig) -> FastAPI:
    app = FastAPI(title="cartridges", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    started = int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return ApiError(exc.status_code, str(exc.detail), "invalid_request_error", None, code).response()

    @app.exception_handler(Exception)
    async def crash(_request: Request, exc: Exception):
        return internal(f"{type(exc).__name__}: {exc}").response()

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise unauthorized()

    @app.get("/health")
    async def health():
        return {"status": "ok" if engine.stats()["alive"] else "degraded", "model": lm.name,
                "served_model": selector.model_id, **engine.stats(), **selector.describe()}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        card = {"id": selector.model_id, "object": "model", "created": started, "owned_by": "cartridges",
                "base_model": lm.name, **selector.describe()}
        return {"object": "list", "data": [card]}

    @app.post("/admin/reload")
    async def reload(request: Request):
        authorize(request)
        try:
            info = await run_in_threadpool(selector.reload)
        except CartridgeError as exc:
            version = selector.describe().get("version")
            raise ApiError(422, f"reload failed, still serving version {version}: {exc}", "invalid_request_error",
                           None, "reload_failed") from exc
        return {"status": "reloaded", **info}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        authorize(request)
        try:
            raw = await request.body()
        except ClientDisconnect:  # gone before its body arrived: nobody to answer
            return Response(status_code=400)
        params = parse_chat(raw, config)
        if params.model != selector.model_id:
            raise ApiError(404, f"model '{params.model}' is not served here; /v1/models lists '{selector.model_id}'",
                           "invalid_request_error", "model", "model_not_found")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job = engine.submit(params, lambda kind, data: loop.call_soon_threadsafe(events.put_nowait, (kind, data)))
        try:
            kind, info = await events.get()
            if kind == "error":
                raise info
            assert isinstance(info, Accepted)
        except BaseException:
            engine.cancel(job)
            raise
        headers = {"X-Cartridges": ",".join(info.names)}
        if info.fleet_version is not None:
            headers["X-Fleet-Version"] = info.fleet_version
        if params.stream:
            return StreamingResponse(_sse(engine, lm, job, events, info, params), media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache"})
        try:
            return JSONResponse(await _complete(engine, lm, job, events, info, params, request), headers=headers)
        finally:
            engine.cancel(job)

    return app


def _usage(info: Accepted, completion: int) -> dict:
    return {"prompt_tokens": info.prompt_tokens, "completion_tokens": completion,
            "total_tokens": info.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": info.cached_tokens},
            "cartridge_rows": info.cartridge_rows}


def _envelope(job: Job, info: Accepted, obj: str) -> dict:
    out = {"id": job.id, "object": obj, "created": int(job.created), "model": job.params.model,
           "system_fingerprint": f"v{info.version}", "cartridges": list(info.names)}
    if info.fleet_version is not None:
        out["fleet_version"] = info.fleet_version
    return out


async def _tokens(engine: Engine, lm: LoadedModel, job: Job, events: asyncio.Queue, params: ChatParams,
                  request: Request | None = None) -> AsyncIterator[tuple[str, str | None, int]]:
    """(text delta, finish reason or None, tokens so far) as the engine produces tokens."""
    text = TextStream(lm.tokenizer, params.stop, skip=engine.eot)
    count = 0
    while True:
        try:
            kind, data = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            if request is not None and await request.is_disconnected():
                engine.cancel(job)
                return
            continue
        if kind == "error":
            raise data
        if kind == "token":
            count += 1
            delta = text.feed(data)
            if text.stopped:
                engine.cancel(job)
                yield delta, "stop", count
                return
            if delta:
                yield delta, None, count
        elif kind == "done":
            yield text.flush(), data["finish_reason"], count
            return


async def _complete(engine: Engine, lm: LoadedModel, job: Job, events: asyncio.Queue, info: Accepted,
                    params: ChatParams, request: Request) -> dict:
    parts, finish, count = [], None, 0
    async for delta, reason, n in _tokens(engine, lm, job, events, params, request):
        parts.append(delta)
        count = n
        finish = reason or finish
    message = {"role": "assistant", "content": "".join(parts)}
    return {**_envelope(job, info, "chat.completion"),
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": _usage(info, count)}


async def _sse(engine: Engine, lm: LoadedModel, job: Job, events: asyncio.Queue, info: Accepted,
               params: ChatParams) -> AsyncIterator[str]:
    head = _envelope(job, info, "chat.completion.chunk")

    def chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> str:
        body = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        if params.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    try:
        yield chunk({"role": "assistant", "content": ""})
        count = 0
        try:
            async for delta, reason, n in _tokens(engine, lm, job, events, params):
                count = n
                if delta:
                    yield chunk({"content": delta})
                if reason:
                    yield chunk({}, reason)
        except ApiError as err:
            yield f"data: {json.dumps(err.body())}\n\n"
        if params.include_usage:
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': _usage(info, count)})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        engine.cancel(job)
