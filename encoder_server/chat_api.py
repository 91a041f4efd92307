"""OpenAI-shaped `/v1/chat/completions` and `/v1/completions`: request parsing into an engine `Generate`, and the
response / stream-chunk bodies (no HTTP here)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from encoder_server.api import ApiError, encode_item, parse_media_part
from encoder_server.config import PreprocessConfig
from engine_link import protocol as p
from preprocess.fetch import FetchPolicy

ROLES = ("system", "user", "assistant", "developer")
MAX_STOP = 4
MAX_STOP_CHARS = 256


@dataclass(frozen=True)
class ChatRequest:
    generate: p.Generate
    blobs: list[bytes]  # inline media, in item order (the `inline` items of `generate.items`)
    item_params: dict[int, str]  # item index -> where it was in the request, e.g. "messages[1].content[2]"
    stream: bool
    include_usage: bool
    model: str | None
    created: int


def _number(body: dict[str, Any], name: str, low: float, high: float, default: float | None) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    # NOTE: the range check also refuses NaN and +-Infinity (json.loads accepts them); math.isfinite would
    # overflow on a huge JSON integer (10**400)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ApiError(400, f"'{name}' must be a number in [{low:g}, {high:g}]", param=name)
    return float(value)


def _sampling(body: dict[str, Any], max_completion_tokens: int) -> tuple[dict[str, Any], tuple[str, ...]]:
    """`SamplingParams` fields and stop strings of an OpenAI body."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = min(256, max_completion_tokens)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= max_completion_tokens:
        raise ApiError(400, f"'max_tokens' must be an integer in [1, {max_completion_tokens}]", param="max_tokens")
    n = body.get("n", 1)
    if n != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise ApiError(400, "'seed' must be a non-negative integer", param="seed")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise ApiError(400, f"'stop' must be a string or a list of up to {MAX_STOP} non-empty strings", param="stop")
    ignore_eos = body.get("ignore_eos", False)  # vLLM's extension: generate max_tokens whatever the model says
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, "'ignore_eos' must be a boolean", param="ignore_eos")
    sampling = {"temperature": _number(body, "temperature", 0, 2, 1.0), "top_p": _number(body, "top_p", 0, 1, 1.0),
                "max_tokens": max_tokens, "seed": seed, "ignore_eos": ignore_eos}
    if sampling["top_p"] == 0:
        raise ApiError(400, "'top_p' must be > 0", param="top_p")
    return sampling, tuple(stop)


def _common(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    return {"model": model, "stream": stream, "include_usage": bool(options.get("include_usage"))}


def parse_chat_request(body: Any, policy: FetchPolicy, prep: PreprocessConfig, max_items: int,
                       max_completion_tokens: int) -> ChatRequest:
    """Validate a chat body; media parts become encoder items (sources checked, `data:` decoded).

    Raises:
        ApiError: 4xx naming the offending field, e.g. `messages[1].content[0]`.
    """
    common = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    turns, items, blobs, where = [], [], [], {}
    for i, msg in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            raise ApiError(400, f"{param}: needs a 'role' in {ROLES}", param=param)
        content = msg.get("content")
        parts: list[str | int] = []
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            for j, part in enumerate(content):
                where_j = f"{param}.content[{j}]"
                if isinstance(part, dict) and part.get("type") == "text":
                    if not isinstance(part.get("text"), str):
                        raise ApiError(400, f"{where_j}: a text part needs a 'text' string", param=where_j)
                    parts.append(part["text"])
                    continue
                if len(items) >= max_items:
                    raise ApiError(400, f"more than {max_items} media items", param=where_j, code="too_many_items")
                item, blob = encode_item(parse_media_part(part, where_j, policy, prep), len(items), where_j, policy)
                items.append(item)
                where[item.index] = where_j
                if blob is not None:
                    blobs.append(blob)
                parts.append(item.index)
        elif content is not None or msg["role"] != "assistant":
            raise ApiError(400, f"{param}: 'content' must be a string or a list of content parts", param=param)
        turns.append({"role": "system" if msg["role"] == "developer" else msg["role"], "parts": parts})
    sampling, stop = _sampling(body, max_completion_tokens)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    generate = p.Generate(request_id, turns=turns, items=tuple(items), sampling=sampling, stop=stop)
    return ChatRequest(generate, blobs, where, common["stream"], common["include_usage"], common["model"],
                       int(time.time()))


def parse_completion_request(body: Any, max_completion_tokens: int, vocab_size: int) -> ChatRequest:
    """`/v1/completions`: `prompt` is a string or a list of token ids (one prompt)."""
    common = _common(body)
    prompt = body.get("prompt")
    text, token_ids = None, None
    if isinstance(prompt, str) and prompt:
        text = prompt
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt):
        token_ids = list(prompt)
    else:
        raise ApiError(400, f"'prompt' must be a non-empty string or a list of token ids in [0, {vocab_size})",
                       param="prompt")
    sampling, stop = _sampling(body, max_completion_tokens)
    generate = p.Generate(f"cmpl-{uuid.uuid4().hex}", prompt_text=text, prompt_token_ids=token_ids,
                          sampling=sampling, stop=stop)
    return ChatRequest(generate, [], {}, common["stream"], common["include_usage"], common["model"], int(time.time()))


def usage(delta: p.TokenDelta) -> dict[str, Any]:
    return {"prompt_tokens": delta.prompt_tokens, "completion_tokens": delta.completion_tokens,
            "total_tokens": delta.prompt_tokens + delta.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": delta.cached_tokens}}


def error_of(delta: p.TokenDelta, req: ChatRequest) -> ApiError:
    """The ApiError of a failed request, naming the media item that caused it."""
    param = req.item_params.get(delta.error_item) if delta.error_item is not None else None
    message = f"{param}: {delta.error_message}" if param else (delta.error_message or "generation failed")
    return ApiError(delta.error_status if delta.error_status >= 400 else 500, message, param=param,
                    code=delta.error_code or "internal")


def chat_response(req: ChatRequest, model: str, text: str, last: p.TokenDelta) -> dict[str, Any]:
    return {"id": req.generate.request_id, "object": "chat.completion", "created": req.created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": last.finish_reason, "logprobs": None}],
            "usage": usage(last), "timings_ms": last.timings_ms}


def chat_chunk(req: ChatRequest, model: str, delta: dict[str, Any] | None, finish_reason: str | None = None,
               usage_of: p.TokenDelta | None = None) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
    chunk = {"id": req.generate.request_id, "object": "chat.completion.chunk", "created": req.created,
             "model": model, "choices": choices}
    if usage_of is not None:
        chunk["usage"] = usage(usage_of)
        chunk["timings_ms"] = usage_of.timings_ms  # sized / encode / first_token / total, as in the JSON answer
    return chunk


def completion_response(req: ChatRequest, model: str, text: str, last: p.TokenDelta) -> dict[str, Any]:
    return {"id": req.generate.request_id, "object": "text_completion", "created": req.created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": last.finish_reason, "logprobs": None}],
            "usage": usage(last)}


def completion_chunk(req: ChatRequest, model: str, text: str | None, finish_reason: str | None = None,
                     usage_of: p.TokenDelta | None = None) -> dict[str, Any]:
    choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}]
    chunk = {"id": req.generate.request_id, "object": "text_completion", "created": req.created, "model": model,
             "choices": choices}
    if usage_of is not None:
        chunk["usage"] = usage(usage_of)
    return chunk
