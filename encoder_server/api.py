"""OpenAI-shaped request parsing and response building for `/v1/embeddings` (no HTTP here)."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

import numpy as np

from cache.keys import route_key
from encoder_server import messages as m
from encoder_server.config import PreprocessConfig
from encoder_server.json_splice import Base64Bytes, FloatArray
from encoder_server.video_options import parse_video_options
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


@dataclass(frozen=True)
class MediaPart:
    modality: str
    source: str  # URL / local path / "data:..." / "" (uuid only, or inline audio)
    uuid: str | None = None
    options: dict[str, float | int] | None = None
    inline: bytes | None = None  # `input_audio` data


_PART_FIELDS = {"image_url": "image", "video_url": "video", "audio_url": "audio"}
AUDIO_FORMATS = ("wav", "mp3", "flac")


def parse_media_part(part: Any, param: str, policy: FetchPolicy, prep: PreprocessConfig) -> MediaPart:
    """One input entry: a URL string (an image) or a content part `image_url` / `video_url` / `audio_url` /
    `input_audio`, with an optional client `uuid`. With a uuid the media may be omitted (source "") when the
    client expects its embedding to be cached. Video parts may carry qwen-vl-utils sampling options
    (`fps`, `nframes`, `video_start`, `video_end`, `min_pixels`, `max_pixels`, ...) in the part or its
    `video_url` object.
    """
    if isinstance(part, str):
        if not part:
            raise ApiError(400, f"{param}: empty URL", param=param)
        return MediaPart("image", part)
    if isinstance(part, int | list):
        raise ApiError(400, f"{param}: token-id input is not supported; this model embeds images, video and audio",
                       param=param, code="unsupported_content")
    if not isinstance(part, dict):
        raise ApiError(400, f"{param}: expected a URL string or a content part, got {type(part).__name__}",
                       param=param)
    kind = part.get("type", "image_url")
    if kind not in (*_PART_FIELDS, "input_audio"):
        raise ApiError(400, f"{param}: content part type {kind!r} is not supported (use one of "
                       f"{sorted((*_PART_FIELDS, 'input_audio'))})", param=param, code="unsupported_content")
    uuid = part.get("uuid")
    if uuid is not None and (not isinstance(uuid, str) or not 0 < len(uuid) <= MAX_UUID_CHARS):
        raise ApiError(400, f"{param}: uuid must be a string of 1..{MAX_UUID_CHARS} characters", param=param)
    if kind == "input_audio":
        return MediaPart("audio", "", uuid, inline=_input_audio(part.get("input_audio"), param, policy))
    modality, inner = _PART_FIELDS[kind], part.get(kind)
    url = inner.get("url") if isinstance(inner, dict) else inner
    options = None
    if modality == "video":
        raw = {**part, **inner} if isinstance(inner, dict) else part
        try:
            options = parse_video_options(raw, prep)
        except ValueError as e:
            raise ApiError(400, f"{param}: {e}", param=param, code="bad_video_options") from None
    if isinstance(url, str) and url:
        return MediaPart(modality, url, uuid, options)
    if not url and uuid is not None:
        return MediaPart(modality, "", uuid, options)
    raise ApiError(400, f"{param}: {kind} needs a 'url' string (or a uuid of cached media)", param=param)


def _input_audio(value: Any, param: str, policy: FetchPolicy) -> bytes:
    """The bytes of an OpenAI `input_audio` object: `{"data": <base64>, "format": "wav" | "mp3" | "flac"}`."""
    if not isinstance(value, dict) or not isinstance(value.get("data"), str):
        raise ApiError(400, f"{param}: input_audio needs {{'data': <base64>, 'format': ...}}", param=param)
    fmt = value.get("format")
    if fmt not in AUDIO_FORMATS:
        raise ApiError(400, f"{param}: input_audio format must be one of {AUDIO_FORMATS}, got {fmt!r}", param=param,
                       code="unsupported_media_type")
    data = value["data"]
    if len(data) > policy.max_bytes * 4 // 3 + 4:
        raise ApiError(413, f"{param}: input_audio is above the limit of {policy.max_bytes} bytes", param=param,
                       code="media_too_large")
    try:
        return base64.b64decode(data, validate=True)
    except (ValueError, binascii.Error):
        raise ApiError(400, f"{param}: input_audio data is not valid base64", param=param) from None


def parse_embeddings_request(body: Any, policy: FetchPolicy, max_items: int,
                             prep: PreprocessConfig | None = None) -> EmbeddingsRequest:
    """Validate the JSON body; decode `data:` URIs and `input_audio`; check every source without touching
    the network. `prep` holds the limits video options are checked against (default: the defaults).

    Raises:
        ApiError: 4xx naming the offending field or `input[i]`.
    """
    prep = prep or PreprocessConfig()
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
        item, blob = encode_item(parse_media_part(entry, f"input[{i}]", policy, prep), i, f"input[{i}]", policy)
        items.append(item)
        if blob is not None:
            inline[i] = blob
    return EmbeddingsRequest(items, inline, encoding_format, pooling, model)


def encode_item(part: MediaPart, index: int, param: str, policy: FetchPolicy) -> tuple[m.EncodeItem, bytes | None]:
    """The `EncodeItem` of a media part (and its inline bytes): source checked, `data:` decoded, route key set.

    Raises:
        ApiError: a forbidden or malformed source, named by `param`.
    """
    try:
        if part.source:
            check_source(part.source, policy)
        if part.inline is not None or part.source.startswith("data:"):
            _check_data_mime(part.source, part.modality)
            blob = part.inline if part.inline is not None else decode_data_uri(part.source, policy.max_bytes)
            route = route_key(uuid=part.uuid, inline=blob)
            return m.EncodeItem(index, part.modality, "data:", inline=True, route_key=route, uuid=part.uuid,
                                options=part.options), blob
        route = route_key(uuid=part.uuid, url=part.source or None)
        return m.EncodeItem(index, part.modality, part.source, route_key=route, uuid=part.uuid,
                            options=part.options), None
    except MediaError as e:
        raise ApiError(e.status, f"{param}: {e.message}", param=param, code=e.code) from None


def _check_data_mime(source: str, modality: str) -> None:
    """A `data:` URI's MIME type, when it names one, must be of the part's modality or generic `application/*`
    (`data:text/html,...` as an image is refused here, not sniffed later)."""
    mime = source[5:].partition(",")[0].partition(";")[0].strip().lower()
    if mime and not mime.startswith((f"{modality}/", "application/")):
        raise MediaError(f"data: URI of type {mime[:64]!r} cannot be used as {modality}", status=415,
                         code="unsupported_media_type")


def _encode(array: np.ndarray, fmt: str) -> Any:
    if fmt == "base64":  # serialized by json_splice without a str copy or an escape scan
        return Base64Bytes(base64.b64encode(np.ascontiguousarray(array, dtype="<f4").data))
    return FloatArray(array)  # formatted by json_splice a block at a time, between event-loop turns


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
