"""Messages on the gateway <-> engine link (ZeroMQ DEALER -> the engine's ROUTER).

Frame 0 is a JSON header (one dataclass below), then raw byte frames (the inline media of a request). The
gateway sends `Generate` / `Abort` / `m.Ping`; the engine answers `EngineReady` to pings and streams
`TokenDelta`s per request, the last one with `finished` (or an error). Nothing is pickled.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from encoder_server import messages as m


@dataclass(frozen=True)
class Generate:
    """One generation. Exactly one of `turns` (chat: role + parts, a part is text or a media item index) and
    `prompt_token_ids` / `prompt_text` (completions) is set. `items` are the media, `inline` flags as in
    `EncodeRequest`; `sampling` holds `SamplingParams` fields."""

    request_id: str
    turns: list[dict[str, Any]] | None = None
    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None
    items: tuple[m.EncodeItem, ...] = ()
    sampling: dict[str, Any] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    kind: str = field(default="generate", init=False)


@dataclass(frozen=True)
class Abort:
    request_id: str
    kind: str = field(default="abort", init=False)


@dataclass(frozen=True)
class TokenDelta:
    """New output of one request. The last one has `finished` and the usage, or an error (`error_code`); an
    error names the media item (`error_item`) when one caused it."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error_code: str | None = None
    error_message: str | None = None
    error_status: int = 200
    error_item: int | None = None
    timings_ms: dict[str, float] = field(default_factory=dict)
    kind: str = field(default="delta", init=False)


@dataclass(frozen=True)
class EngineReady:
    """The answer to a ping: what the engine serves, and its load right now."""

    model: str
    vocab_size: int
    hidden_size: int
    pid: int
    num_requests: int = 0  # requests the engine holds (waiting for media, queued or generating)
    kv_full_used: int = 0  # slots in use (running requests + prefix cache)
    kv_swa_used: int = 0
    kind: str = field(default="engine_ready", init=False)


_KINDS: dict[str, type] = {"generate": Generate, "abort": Abort, "delta": TokenDelta, "engine_ready": EngineReady,
                           "ping": m.Ping}


def pack(msg: Any) -> bytes:
    return json.dumps(asdict(msg), separators=(",", ":")).encode()


def unpack(frame: bytes | memoryview) -> Any:
    """Parse a header frame into its dataclass. Raises ValueError on anything malformed."""
    try:
        d = json.loads(bytes(frame))
        cls = _KINDS[d.pop("kind")]
        if cls is Generate:
            d["items"] = tuple(m.EncodeItem(**it) for it in d.get("items", ()))
            d["stop"] = tuple(d.get("stop", ()))
        return cls(**d)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"malformed engine message: {e}") from None
