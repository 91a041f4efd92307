"""The HTTP gateway (aiohttp): `/v1/embeddings`, `/v1/models`, `/health`.

Every error leaves as OpenAI-shaped JSON with a 4xx/5xx status; no stack trace ever reaches a client.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from aiohttp import web

from encoder_server.api import ApiError, build_embeddings_response, parse_embeddings_request
from encoder_server.config import ServerArgs
from encoder_server.worker import fetch_policy
from encoder_server.worker_client import WorkerClient, WorkerUnavailable

log = logging.getLogger(__name__)

CLIENTS = web.AppKey("clients", list)
ARGS = web.AppKey("args", ServerArgs)


def _error(exc: ApiError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


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


async def _json_body(request: web.Request) -> Any:
    raw = await request.read()
    if not raw:
        raise ApiError(400, "empty request body; expected JSON")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None


def _pick_worker(request: web.Request) -> WorkerClient:
    ready = [c for c in request.app[CLIENTS] if c.ready is not None]
    if not ready:
        raise ApiError(503, "no encoder worker is ready", code="unavailable")
    return ready[0]


async def embeddings(request: web.Request) -> web.Response:
    args = request.app[ARGS]
    start = time.perf_counter()
    body = await _json_body(request)
    req = parse_embeddings_request(body, fetch_policy(args.fetch), args.max_items_per_request)
    parse_ms = (time.perf_counter() - start) * 1e3
    client = _pick_worker(request)
    try:
        outputs = await client.encode(req.items, req.blobs, req.pooling, args.request_timeout_s)
    except WorkerUnavailable as e:
        raise ApiError(503, f"encoder worker unavailable: {e}", code="unavailable") from None
    except TimeoutError:
        raise ApiError(504, f"request not finished within {args.request_timeout_s:.0f} s", code="timeout") from None
    total_ms = (time.perf_counter() - start) * 1e3
    response = build_embeddings_response(req, outputs, args.model_name,
                                         {"parse": round(parse_ms, 3), "total": round(total_ms, 3)})
    log.info("embeddings: %d items, %d tokens, %.1f ms", len(req.items), response["usage"]["total_tokens"],
             total_ms)
    return web.json_response(response)


async def models(request: web.Request) -> web.Response:
    args = request.app[ARGS]
    return web.json_response({"object": "list", "data": [
        {"id": args.model_name, "object": "model", "created": 0, "owned_by": "mmenc"}]})


async def health(request: web.Request) -> web.Response:
    workers = [{"address": c.address, "ready": c.ready is not None, "device": c.ready.device if c.ready else None,
                "error": c.dead_reason} for c in request.app[CLIENTS]]
    ok = any(w["ready"] for w in workers)
    return web.json_response({"status": "ok" if ok else "unavailable", "workers": workers},
                             status=200 if ok else 503)


def build_app(args: ServerArgs) -> web.Application:
    """The aiohttp app; the caller puts connected `WorkerClient`s into `app[CLIENTS]` on startup."""
    app = web.Application(middlewares=[error_middleware], client_max_size=args.max_body_bytes)
    app[ARGS] = args
    app[CLIENTS] = []
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app
