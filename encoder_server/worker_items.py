"""What the worker's pipeline stages hand each other: one item, a prepared batch, a forward in flight."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from encoder_server.encode_inputs import EncodeInputs
from preprocess.errors import MediaError
from preprocess.video_sampling import VideoSampling


@dataclass
class Item:
    """One media item between its arrival and its result."""

    identity: bytes  # where its messages go: the ROUTER peer, or a reply_to address (`worker_io.destination`)
    request_id: str
    index: int
    pooling: str
    modality: str
    arrived: float
    ready_at: float = 0.0
    blob: bytes | None = None  # compressed, for decoding on the device
    image: torch.Tensor | None = None  # uint8 [3, H, W] once decoded
    frames: torch.Tensor | None = None  # video: uint8 [T, H, W, 3], the sampled frames
    sampling: VideoSampling | None = None  # video: how its frames were picked and are sized
    waveform: torch.Tensor | None = None  # audio: float32 [N] at 16 kHz
    window_tokens: list[int] = field(default_factory=list)  # audio: tokens kept per 30 s window
    error: MediaError | None = None
    grid: tuple[int, int, int] | None = None  # image / video: (t, h, w) in patches
    num_patches: int = 0  # encoder input positions: the scheduler's token budget counts these
    num_tokens: int = 0  # embedding rows after the merger / the audio encoder
    timings_ms: dict[str, float] = field(default_factory=dict)
    key_variant: str = ""  # what besides the media and the server's settings changes the embedding
    route_key: str | None = None  # cache key known before fetching (uuid / URL / inline bytes)
    content_key: str | None = None  # cache key from the media bytes
    has_uuid: bool = False  # the client named this item; its cache entry must exist before the answer leaves
    wants_size: bool = False  # reply_to requests: an `ItemSized` goes out before the result


@dataclass
class Prepared:
    """A batch whose model inputs are ready (or being uploaded) on the device."""

    items: list[Item]
    inputs: EncodeInputs
    ready: torch.cuda.Event | None
    started: float


@dataclass
class InFlight:
    """A launched forward whose results are being copied to (pinned) host memory."""

    items: list[Item]
    pooled: torch.Tensor  # [N, D] host; valid once the copy event has passed
    tokens: torch.Tensor | None  # [T, D] host, model dtype: for pooling "none" and for the cache
    lengths: list[int]  # output tokens per item
    events: tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event] | None  # start, end, copies done
    host_forward_s: float = 0.0  # without CUDA: the forward ran synchronously in launch(), this long


def to_host(t: torch.Tensor) -> torch.Tensor:
    """Device -> pinned host copy that does not block; valid after an event recorded later has passed."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
