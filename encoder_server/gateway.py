"""The HTTP gateway (aiohttp): `/v1/embeddings`, `/v1/models`, `/health`, `/metrics`, and the chat routes
(`gateway_chat`).

Every error leaves as OpenAI-shaped JSON with a 4xx/5xx status; no stack trace ever reaches a client.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any, Protocol

from aiohttp import web

from encoder_server import json_splice, metrics
from encoder_server import messages as m
from encoder_server.api import ApiError, build_embeddings_response, parse_embeddings_request
from encoder_server.config import ServerArgs
from encoder_server.engine_client import EngineClient
from encoder_server.gateway_chat import ENGINE, add_routes, chat_model_name
from encoder_server.http_common import ARGS, json_body
from encoder_server.worker_client import ItemOutput, WorkerClient, WorkerUnavailable

log = logging.getLogger(__name__)


class WorkerPicker(Protocol):
    clients: list[WorkerClient]

    def pick(self, exclude: WorkerClient | None = None) -> WorkerClient: ...

    def route(self, items: list[m.EncodeItem]) -> dict[WorkerClient, list[m.EncodeItem]]: ...


FLEET = web.AppKey("fleet", WorkerPicker)
INFLIGHT = web.AppKey("inflight", list)  # [requests in flight], mutated only on the event loop
API_PROCESS = web.AppKey("api_process", int)
STREAM_VALUES = 1 << 18  # responses with more embedding values than this are written as they are formatted


def _error(exc: ApiError) -> web.Response:
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
    return web.json_response(exc.body(), status=exc.status, headers=headers)


@web.middleware
async def metrics_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
    start = time.perf_counter()
    response = await handler(request)
    metrics.REQUESTS.labels(route, str(response.status)).inc()
    metrics.REQUEST_SECONDS.labels(route).observe(time.perf_counter() - start)
    return response


_OPEN_ROUTES = ("/health", "/metrics")


@web.middleware
async def admission_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """API key check, then a bound on requests in flight: past it, 429 + Retry-After at once (no queue grows)."""
    args = request.app[ARGS]
    if request.path in _OPEN_ROUTES:
        return await handler(request)
    if args.api_key:
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {args.api_key}".encode()):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)", code="invalid_api_key")
    state = request.app[INFLIGHT]
    if state[0] >= args.max_inflight_requests:
        metrics.ERRORS.labels("overloaded").inc()
        raise ApiError(429, f"server busy: {state[0]} requests in flight; retry shortly", code="overloaded")
    state[0] += 1
    try:
        return await handler(request)
    finally:
        state[0] -= 1


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return _error(e)
    except web.HTTPRequestEntityTooLarge as e:
        return _error(ApiError(413, f"request body too large: {e.text or ''}".strip(), code="body_too_large"))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error(ApiError(e.status, e.reason, code="http_error"))
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error(ApiError(500, "internal server error", code="internal"))


async def _encode_group(fleet: WorkerPicker, client: WorkerClient, items: list[m.EncodeItem], inline: dict[int, bytes],
                        pooling: str, timeout_s: float) -> dict[int, ItemOutput]:
    blobs = [inline[it.index] for it in items if it.inline]
    try:
        return await client.encode(items, blobs, pooling, timeout_s)
    except WorkerUnavailable as first:  # the worker died with these items in flight: once more elsewhere
        log.warning("retrying %d item(s) after: %s", len(items), first)
        return await fleet.pick(exclude=client).encode(items, blobs, pooling, timeout_s)


async def embeddings(request: web.Request) -> web.Response:
    args = request.app[ARGS]
    start = time.perf_counter()
    body = await json_body(request)
    req = parse_embeddings_request(body, args.fetch.policy(), args.max_items_per_request, args.preprocess)
    parse_ms = (time.perf_counter() - start) * 1e3
    fleet = request.app[FLEET]
    try:
        groups = fleet.route(req.items)  # items split by the worker that owns their route key
        busy = [c for c, items in groups.items() if c.num_inflight_items + len(items) > args.max_worker_items]
        if busy and any(c.num_inflight_items for c in busy):  # NOTE: one request larger than the bound still runs
            metrics.ERRORS.labels("overloaded").inc()
            raise ApiError(429, f"encoder worker busy: {busy[0].num_inflight_items} items queued; retry shortly",
                           code="overloaded")
        parts = await asyncio.gather(*(_encode_group(fleet, client, items, req.inline, req.pooling,
                                                     args.request_timeout_s) for client, items in groups.items()))
        outputs = {index: out for part in parts for index, out in part.items()}
    except WorkerUnavailable as e:
        raise ApiError(503, f"encoder worker unavailable: {e}", code="unavailable") from None
    except TimeoutError:
        raise ApiError(504, f"request not finished within {args.request_timeout_s:.0f} s", code="timeout") from None
    total_ms = (time.perf_counter() - start) * 1e3
    response = build_embeddings_response(req, outputs, args.model_name,
                                         {"parse": round(parse_ms, 3), "total": round(total_ms, 3)})
    log.debug("embeddings: %d items, %d tokens, %.1f ms", len(req.items), response["usage"]["total_tokens"],
             total_ms)
    if sum(out.array.size for out in outputs.values() if out.array is not None) <= STREAM_VALUES:
        return web.Response(body=json_splice.dumps(response), content_type="application/json")
    return await _stream_json(request, response)


async def _stream_json(request: web.Request, obj: dict[str, Any]) -> web.StreamResponse:
    """Write a large body as it is formatted, giving the event loop back between blocks of numbers, so one
    client's full-token float embeddings (seconds of formatting) do not stall every other request."""
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    pending: list[bytes] = []
    try:
        for piece in json_splice.pieces(obj):
            if piece is not None:
                pending.append(piece)
                continue
            await resp.write(b"".join(pending))
            pending.clear()
            await asyncio.sleep(0)
        await resp.write(b"".join(pending))
        await resp.write_eof()
    except ConnectionError:  # the client left mid-answer: nothing to tell it, stop formatting
        log.info("client of %s went away during a streamed answer", request.path)
    return resp


async def models(request: web.Request) -> web.Response:
    args = request.app[ARGS]
    data = [{"id": args.model_name, "object": "model", "created": 0, "owned_by": "mmenc"}]
    if request.app.get(ENGINE) is not None:
        data.append({"id": chat_model_name(args.engine.llm), "object": "model", "created": 0, "owned_by": "mmenc"})
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    workers = [{"address": c.address, "ready": c.ready is not None, "device": c.ready.device if c.ready else None,
                "pid": c.ready.pid if c.ready else None,
                "error": c.dead_reason, "inflight_items": c.num_inflight_items} for c in request.app[FLEET].clients]
    ok = any(w["ready"] for w in workers)
    body: dict[str, Any] = {"status": "ok" if ok else "unavailable", "api_process": request.app[API_PROCESS],
                            "workers": workers}
    if (engine := request.app.get(ENGINE)) is not None:
        ready = engine.ready
        body["engine"] = {"address": engine.address, "ready": ready is not None, "pid": ready.pid if ready else None,
                          "error": engine.dead_reason, "running": ready.num_requests if ready else 0,
                          "kv_full_used": ready.kv_full_used if ready else 0,
                          "kv_swa_used": ready.kv_swa_used if ready else 0}
    return web.json_response(body, status=200 if ok else 503)


async def metrics_text(request: web.Request) -> web.Response:
    return web.Response(body=metrics.render(), content_type="text/plain", charset="utf-8")


def build_app(args: ServerArgs, fleet: WorkerPicker, engine: EngineClient | None = None,
              api_process: int = 0) -> web.Application:
    """The aiohttp app over `fleet` (anything with `clients` and `pick`) and, for the chat routes, `engine`;
    `api_process`: which of the `--api-processes` HTTP processes serves it (reported by /health)."""
    app = web.Application(middlewares=[metrics_middleware, error_middleware, admission_middleware],
                          client_max_size=args.max_body_bytes)
    app[ARGS] = args
    app[INFLIGHT] = [0]
    app[FLEET] = fleet
    app[API_PROCESS] = api_process
    if engine is not None:
        app[ENGINE] = engine
    add_routes(app)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_text)
    return app
