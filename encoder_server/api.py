"""OpenAI-shaped request parsing and response building for `/v1/embeddings` (no HTTP here)."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np

from cache.keys import route_key
from encoder_server import messages as m
from encoder_server.worker_client import ItemOutput
from preprocess.errors import MediaError
from preprocess.fetch import FetchPolicy, check_source, decode_data_uri

ENCODING_FORMATS = ("float", "base64")


class ApiError(Exception):
    """A request the API refuses: becomes `{"error": {...}}` with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


MAX_UUID_CHARS = 256


@dataclass(frozen=True)
class EmbeddingsRequest:
    items: list[m.EncodeItem]
    inline: dict[int, bytes]  # item index -> bytes of the items with `inline=True`
    encoding_format: str
    pooling: str
    model: str | None


def _item_source(part: Any, param: str) -> tuple[str, str, str | None]:
    """(modality, source, uuid) of one input entry: a string, or an `image_url` content part.

    A part may carry a client `uuid` naming its media; with a uuid the url may be omitted (source "")
    when the client expects the embedding to be cached.
    """
    if isinstance(part, str):
        return "image", part, None
    if isinstance(part, dict):
        kind = part.get("type", "image_url")
        if kind != "image_url":
            raise ApiError(400, f"{param}: content part type {kind!r} is not supported (use 'image_url')",
                           param=param, code="unsupported_content")
        uuid = part.get("uuid")
        if uuid is not None and (not isinstance(uuid, str) or not 0 < len(uuid) <= MAX_UUID_CHARS):
            raise ApiError(400, f"{param}: uuid must be a string of 1..{MAX_UUID_CHARS} characters", param=param)
        url = part.get("image_url")
        if isinstance(url, dict):
            url = url.get("url")
        if isinstance(url, str):
            return "image", url, uuid
        if url is None and uuid is not None:
            return "image", "", uuid
        raise ApiError(400, f"{param}: image_url needs a 'url' string (or a uuid of cached media)", param=param)
    if isinstance(part, int | list):
        raise ApiError(400, f"{param}: token-id input is not supported; this model embeds images",
                       param=param, code="unsupported_content")
    raise ApiError(400, f"{param}: expected a URL string or an image_url content part, got {type(part).__name__}",
                   param=param)


def parse_embeddings_request(body: Any, policy: FetchPolicy, max_items: int) -> EmbeddingsRequest:
    """Validate the JSON body; decode `data:` URIs; check every source without touching the network.

    Raises:
        ApiError: 4xx naming the offending field or `input[i]`.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    if "input" not in body:
        raise ApiError(400, "'input' is required", param="input")
    raw = body["input"]
    entries = raw if isinstance(raw, list) else [raw]
    if not entries:
        raise ApiError(400, "'input' is empty", param="input")
    if len(entries) > max_items:
        raise ApiError(400, f"'input' has {len(entries)} items; the limit is {max_items}", param="input",
                       code="too_many_items")
    encoding_format = body.get("encoding_format") or "float"
    if encoding_format not in ENCODING_FORMATS:
        raise ApiError(400, f"encoding_format must be one of {ENCODING_FORMATS}", param="encoding_format")
    pooling = body.get("pooling") or "mean"
    if pooling not in m.POOLINGS:
        raise ApiError(400, f"pooling must be one of {m.POOLINGS}", param="pooling")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model")

    items: list[m.EncodeItem] = []
    inline: dict[int, bytes] = {}
    for i, entry in enumerate(entries):
        param = f"input[{i}]"
        modality, source, uuid = _item_source(entry, param)
        try:
            if source:
                check_source(source, policy)
            if source.startswith("data:"):
                inline[i] = decode_data_uri(source, policy.max_bytes)
                route = route_key(uuid=uuid, inline=inline[i])
                items.append(m.EncodeItem(i, modality, "data:", inline=True, route_key=route, uuid=uuid))
            else:
                route = route_key(uuid=uuid, url=source or None)
                items.append(m.EncodeItem(i, modality, source, route_key=route, uuid=uuid))
        except MediaError as e:
            raise ApiError(e.status, f"{param}: {e.message}", param=param, code=e.code) from None
    return EmbeddingsRequest(items, inline, encoding_format, pooling, model)


def _encode(array: np.ndarray, fmt: str) -> Any:
    if fmt == "base64":
        return base64.b64encode(np.ascontiguousarray(array, dtype="<f4").tobytes()).decode()
    return array.tolist()


def build_embeddings_response(req: EmbeddingsRequest, outputs: dict[int, ItemOutput], model_name: str,
                              gateway_ms: dict[str, float]) -> dict[str, Any]:
    """OpenAI `list` of embeddings, or raise ApiError for the first failed item (by index)."""
    for item in req.items:
        res = outputs[item.index].result
        if not res.ok:
            raise ApiError(res.error_status, f"input[{item.index}]: {res.error_message}",
                           param=f"input[{item.index}]", code=res.error_code or "invalid_media")
    data = []
    for item in req.items:
        out = outputs[item.index]
        assert out.array is not None
        entry: dict[str, Any] = {
            "object": "embedding",
            "index": item.index,
            "embedding": _encode(out.array, req.encoding_format),
            "num_tokens": out.result.num_tokens,
            "grid_thw": list(out.result.grid_thw or ()),
            "timings_ms": out.result.timings_ms,
        }
        if req.pooling == "none":
            entry["shape"] = list(out.array.shape)
        data.append(entry)
    total = sum(outputs[it.index].result.num_tokens for it in req.items)
    return {
        "object": "list",
        "data": data,
        "model": model_name,
        "usage": {"prompt_tokens": total, "total_tokens": total},
        "timings_ms": gateway_ms,
    }
