"""Messages on the gateway <-> encoder worker link (ZeroMQ DEALER -> ROUTER).

Each message is a multipart: frame 0 is a small JSON header (one of the dataclasses below), the rest
are raw byte frames (inline media going in, tensor bytes coming out). Nothing is pickled.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

POOLINGS = ("mean", "none")


@dataclass(frozen=True)
class EncodeItem:
    """One media item. `source` is a URL or local path; with `inline` its bytes ride in a frame.

    `route_key` (uuid, else URL, else inline-bytes hash: `cache.keys.route_key`) picks the worker on the
    ring and keys the cache before any download; `uuid` is the client's own media id, if given.
    """

    index: int
    modality: str
    source: str
    inline: bool = False
    route_key: str = ""
    uuid: str | None = None
    options: dict[str, float | int] | None = None  # video sampling options (`encoder_server.video_options`)


@dataclass(frozen=True)
class EncodeRequest:
    """Items to encode. Results go back to the sender, or with `reply_to` (a ZeroMQ address, e.g. the engine's
    receiver) are pushed there instead, each preceded by an `ItemSized` as soon as its size is known; the
    sender then only gets an `Accepted`."""

    request_id: str
    items: tuple[EncodeItem, ...]
    pooling: str = "mean"
    reply_to: str = ""
    kind: str = field(default="encode", init=False)


@dataclass(frozen=True)
class Accepted:
    """Worker -> sender of a `reply_to` request: the worker has the request (its results go to reply_to)."""

    request_id: str
    pid: int = 0  # the worker process (a different pid later means it restarted and lost the request)
    kind: str = field(default="accepted", init=False)


@dataclass(frozen=True)
class ItemSized:
    """Worker -> reply_to: an item's token count and grid, known after fetch/probe and before its forward, so
    the engine can lay out the prompt while the item is still being encoded."""

    request_id: str
    index: int
    modality: str
    num_tokens: int
    grid_thw: tuple[int, int, int] | None = None
    content_key: str = ""  # the embedding's cache key (media bytes + params + encoder), when known: a prefix-cache key
    kind: str = field(default="sized", init=False)


@dataclass(frozen=True)
class ItemResult:
    """Result for one item: an embedding (in the next frame) or an error. Sent as soon as it exists."""

    request_id: str
    index: int
    error_code: str | None = None
    error_message: str | None = None
    error_status: int = 200
    dtype: str = "float32"
    shape: tuple[int, ...] = ()
    grid_thw: tuple[int, int, int] | None = None
    num_tokens: int = 0
    timings_ms: dict[str, float] = field(default_factory=dict)
    kind: str = field(default="result", init=False)

    @property
    def ok(self) -> bool:
        return self.error_code is None


@dataclass(frozen=True)
class WorkerReady:
    """Sent once on connect/ping: the worker has loaded its model and accepts requests."""

    model_fingerprint: str
    device: str
    out_dim: int
    pid: int
    kind: str = field(default="ready", init=False)


@dataclass(frozen=True)
class Ping:
    kind: str = field(default="ping", init=False)


_KINDS: dict[str, type] = {"encode": EncodeRequest, "result": ItemResult, "ready": WorkerReady, "ping": Ping,
                           "accepted": Accepted, "sized": ItemSized}


def pack(msg: Any) -> bytes:
    return json.dumps(asdict(msg), separators=(",", ":")).encode()


def unpack(frame: bytes | memoryview) -> Any:
    """Parse a header frame into its dataclass. Raises ValueError on anything malformed."""
    try:
        d = json.loads(bytes(frame))
        cls = _KINDS[d.pop("kind")]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"malformed header frame: {e}") from None
    if cls is EncodeRequest:
        d["items"] = tuple(EncodeItem(**it) for it in d["items"])
    if cls is ItemResult:
        d["shape"] = tuple(d["shape"])
    if cls in (ItemResult, ItemSized):
        d["grid_thw"] = tuple(d["grid_thw"]) if d.get("grid_thw") is not None else None
    try:
        return cls(**d)
    except TypeError as e:
        raise ValueError(f"malformed {cls.__name__} header: {e}") from None


def tensor_frame(t: torch.Tensor) -> memoryview:
    """Raw bytes of a CPU tensor (contiguous), for `send_multipart(..., copy=False)`."""
    return memoryview(t.detach().contiguous().numpy()).cast("B")


def frame_tensor(frame: bytes | memoryview, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer(frame, dtype=np.dtype(dtype)).reshape(shape)
