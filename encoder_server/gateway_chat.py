"""HTTP routes of the bundled engine: `/v1/chat/completions` and `/v1/completions` (JSON or SSE streams).

A request that fails before its first token (bad media, a prompt too long) gets a plain 4xx JSON error; once
a stream has started, an error ends it with an `error` event. A client that goes away aborts its request in
the engine (its KV is freed).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp import web

from encoder_server.api import ApiError
from encoder_server.chat_api import (
    ChatRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_of,
    parse_chat_request,
    parse_completion_request,
)
from encoder_server.engine_client import EngineClient, EngineUnavailable
from encoder_server.http_common import ARGS, json_body
from engine_link import protocol as p

log = logging.getLogger(__name__)

ENGINE = web.AppKey("engine", EngineClient)


def chat_model_name(llm: str) -> str:
    return f"mimo-v2-flash-{llm}" if "/" not in llm else Path(llm).name


def _engine(request: web.Request) -> EngineClient:
    engine = request.app.get(ENGINE)
    if engine is None:
        raise ApiError(404, "chat is turned off on this server (--llm none)", code="unsupported")
    if engine.ready is None:
        raise ApiError(503, f"the engine is not ready: {engine.dead_reason or 'starting'}", code="unavailable")
    return engine


async def chat_completions(request: web.Request) -> web.StreamResponse:
    args = request.app[ARGS]
    engine = _engine(request)
    req = parse_chat_request(await json_body(request), args.fetch.policy(), args.preprocess,
                             args.max_items_per_request, args.engine.max_completion_tokens)
    return await _respond(request, engine, req, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    args = request.app[ARGS]
    engine = _engine(request)
    assert engine.ready is not None
    req = parse_completion_request(await json_body(request), args.engine.max_completion_tokens,
                                   engine.ready.vocab_size)
    return await _respond(request, engine, req, chat=False)


async def _deltas(engine: EngineClient, req: ChatRequest, idle_timeout_s: float) -> AsyncIterator[p.TokenDelta]:
    """The request's deltas; an error delta raises its ApiError; silence past `idle_timeout_s` is a 504."""
    stream = engine.generate(req.generate, req.blobs)
    try:
        while True:
            try:
                delta = await asyncio.wait_for(anext(stream), idle_timeout_s)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise ApiError(504, f"no output from the engine for {idle_timeout_s:.0f} s", code="timeout") from None
            except EngineUnavailable as e:
                raise ApiError(503, f"engine unavailable: {e}", code="unavailable") from None
            if delta.error_code:
                raise error_of(delta, req)
            yield delta
            if delta.finished:
                return
    finally:
        await stream.aclose()  # NOTE: an unfinished request is aborted in the engine


async def _respond(request: web.Request, engine: EngineClient, req: ChatRequest, chat: bool) -> web.StreamResponse:
    args = request.app[ARGS]
    model = chat_model_name(args.engine.llm)
    deltas = _deltas(engine, req, args.request_timeout_s)
    try:
        first = await anext(deltas)  # errors before the first token are plain JSON errors
        if not req.stream:
            pieces, last = [first.text], first
            async for delta in deltas:
                pieces.append(delta.text)
                last = delta
            body = (chat_response if chat else completion_response)(req, model, "".join(pieces), last)
            return web.json_response(body)
        return await _stream(request, req, model, first, deltas, chat)
    finally:
        await deltas.aclose()


async def _stream(request: web.Request, req: ChatRequest, model: str, first: p.TokenDelta,
                  deltas: AsyncIterator[p.TokenDelta], chat: bool) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(obj: dict[str, Any]) -> None:
        await response.write(f"data: {json.dumps(obj)}\n\n".encode())

    chunk = chat_chunk if chat else completion_chunk
    if chat:
        await send(chat_chunk(req, model, {"role": "assistant", "content": ""}))
    delta: p.TokenDelta | None = first
    try:
        while delta is not None:
            if delta.text or delta.finished:
                content: Any = {"content": delta.text} if chat else delta.text
                await send(chunk(req, model, content, delta.finish_reason if delta.finished else None))
            if delta.finished:
                if req.include_usage:
                    await send(chunk(req, model, None, usage_of=delta))
                break
            delta = await anext(deltas, None)
    except ApiError as e:
        await send(e.body())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
