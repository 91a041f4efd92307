"""Frozen configuration, one dataclass per layer, validated in `__post_init__`.

CLI flags are generated from the fields (`add_config_args` / `config_from_args`), so every default lives
here once. Runtime state lives elsewhere; a config is never mutated after construction.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


@dataclass(frozen=True)
class VisionConfig:
    """Shape of the Qwen2.5-VL vision transformer (field names follow transformers' vision config)."""

    depth: int = 4
    hidden_size: int = 64
    num_heads: int = 4
    intermediate_size: int = 160
    out_hidden_size: int = 128
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (1, 3)
    in_channels: int = 3
    rope_theta: float = 10000.0
    hidden_act: str = "silu"
    seed: int = 0

    def __post_init__(self) -> None:
        _require(self.depth > 0 and self.hidden_size > 0 and self.num_heads > 0, "vision sizes must be > 0")
        _require(self.hidden_size % self.num_heads == 0, "hidden_size must be divisible by num_heads")
        _require(self.head_dim % 4 == 0, "head_dim must be divisible by 4 (2-D rotary)")
        _require(all(0 <= i < self.depth for i in self.fullatt_block_indexes), "fullatt index out of range")
        _require(self.window_size % (self.patch_size * self.spatial_merge_size) == 0,
                 "window_size must be a multiple of patch_size * spatial_merge_size")
        _require(self.hidden_act in ("silu", "gelu", "gelu_pytorch_tanh", "quick_gelu"),
                 f"unsupported hidden_act {self.hidden_act!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: channels * temporal_patch * patch * patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2

    @classmethod
    def preset(cls, name: str) -> VisionConfig:
        if name not in VISION_PRESETS:
            raise ValueError(f"unknown vision preset {name!r}; known: {sorted(VISION_PRESETS)}")
        return VISION_PRESETS[name]

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> VisionConfig:
        """Read a transformers config dict (a full Qwen2.5-VL config or only its vision_config)."""
        d = d.get("vision_config", d)
        rope = d.get("rope_parameters") or {}
        return cls(
            depth=d.get("depth", d.get("num_hidden_layers", 32)),
            hidden_size=d["hidden_size"],
            num_heads=d.get("num_heads", d.get("num_attention_heads", 16)),
            intermediate_size=d["intermediate_size"],
            out_hidden_size=d["out_hidden_size"],
            patch_size=d.get("patch_size", 14),
            temporal_patch_size=d.get("temporal_patch_size", 2),
            spatial_merge_size=d.get("spatial_merge_size", 2),
            window_size=d.get("window_size", 112),
            fullatt_block_indexes=tuple(d.get("fullatt_block_indexes", (7, 15, 23, 31))),
            in_channels=d.get("in_channels", d.get("in_chans", 3)),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            hidden_act=d.get("hidden_act", "silu"),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers `Qwen2_5_VLVisionConfig` keyword arguments for this shape."""
        return dict(
            depth=self.depth, hidden_size=self.hidden_size, num_heads=self.num_heads,
            intermediate_size=self.intermediate_size, out_hidden_size=self.out_hidden_size,
            patch_size=self.patch_size, temporal_patch_size=self.temporal_patch_size,
            spatial_merge_size=self.spatial_merge_size, window_size=self.window_size,
            fullatt_block_indexes=list(self.fullatt_block_indexes), in_channels=self.in_channels,
            hidden_act=self.hidden_act,
        )


VISION_PRESETS: dict[str, VisionConfig] = {
    "tiny": VisionConfig(),
    "qwen2.5-vl-7b": VisionConfig(
        depth=32, hidden_size=1280, num_heads=16, intermediate_size=3420, out_hidden_size=3584,
        window_size=112, fullatt_block_indexes=(7, 15, 23, 31),
    ),
}


@dataclass(frozen=True)
class PreprocessConfig:
    """Image decode + resize/normalize/patchify, as in transformers' `Qwen2VLImageProcessor`."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = _OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = _OPENAI_CLIP_STD
    decode_backend: str = "auto"
    max_source_pixels: int = 64_000_000
    max_aspect_ratio: float = 200.0
    # Video: qwen-vl-utils' defaults; a request may ask for less (fps, nframes, range, pixels), never more.
    video_fps: float = 2.0
    video_min_frames: int = 4
    video_max_frames: int = 768
    video_min_pixels: int = 128 * 28 * 28  # per frame
    video_max_pixels: int = 768 * 28 * 28  # per frame
    video_total_pixels: int = int(128000 * 28 * 28 * 0.9)  # all frames together
    video_decode_threads: int = 8  # keyframe-aligned chunks decoded in parallel per video
    video_decode_backend: str = "decord"  # decord | dali (NVDEC only) | hybrid (CPU chunks + NVDEC side by side)
    video_dali_decoders: int = 2  # DALI decoders per video for dali / hybrid
    max_video_duration_s: float = 3 * 3600.0
    max_video_decoded_bytes: int = 4 << 30  # the sampled frames at source size (T * H * W * 3)
    video_decode_timeout_s: float = 120.0
    max_audio_duration_s: float = 3600.0

    def __post_init__(self) -> None:
        _require(0 < self.min_pixels <= self.max_pixels, "need 0 < min_pixels <= max_pixels")
        _require(self.video_fps > 0 and 0 < self.video_min_frames <= self.video_max_frames,
                 "need video_fps > 0 and 0 < video_min_frames <= video_max_frames")
        _require(0 < self.video_min_pixels <= self.video_max_pixels and self.video_total_pixels > 0,
                 "need 0 < video_min_pixels <= video_max_pixels and video_total_pixels > 0")
        _require(self.video_decode_threads > 0 and self.video_dali_decoders > 0,
                 "video_decode_threads and video_dali_decoders must be > 0")
        _require(self.video_decode_backend in ("decord", "dali", "hybrid"),
                 f"video_decode_backend must be decord|dali|hybrid, got {self.video_decode_backend!r}")
        _require(self.max_video_duration_s > 0 and self.max_video_decoded_bytes > 0
                 and self.video_decode_timeout_s > 0 and self.max_audio_duration_s > 0,
                 "video/audio limits must be > 0")
        _require(self.max_source_pixels > 0, "max_source_pixels must be > 0")
        _require(self.decode_backend in ("auto", "pil", "nvjpeg", "dali"),
                 f"decode_backend must be auto|pil|nvjpeg|dali, got {self.decode_backend!r}")
        _require(len(self.image_mean) == 3 and len(self.image_std) == 3, "mean/std need 3 channels")
        _require(all(s > 0 for s in self.image_std), "image_std must be > 0")

    @property
    def resize_factor(self) -> int:
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class FetchConfig:
    """Where media may come from and how much of it."""

    max_download_bytes: int = 32 * 1024 * 1024
    fetch_timeout_s: float = 10.0
    max_redirects: int = 5
    allow_private_urls: bool = False
    allowed_local_media_dir: str | None = None
    num_fetch_procs: int = 4

    def __post_init__(self) -> None:
        _require(self.max_download_bytes > 0, "max_download_bytes must be > 0")
        _require(self.fetch_timeout_s > 0, "fetch_timeout_s must be > 0")
        _require(self.max_redirects >= 0, "max_redirects must be >= 0")
        _require(self.num_fetch_procs > 0, "num_fetch_procs must be > 0")
        if self.allowed_local_media_dir is not None:
            _require(Path(self.allowed_local_media_dir).is_dir(),
                     f"allowed_local_media_dir {self.allowed_local_media_dir!r} is not a directory")

    def policy(self):  # noqa: ANN201 - a preprocess.fetch.FetchPolicy
        """The fetch policy these settings describe (what may be fetched, how much, how long)."""
        from preprocess.fetch import FetchPolicy

        return FetchPolicy(max_bytes=self.max_download_bytes, timeout_s=self.fetch_timeout_s,
                           max_redirects=self.max_redirects, allow_private=self.allow_private_urls,
                           allowed_local_dir=self.allowed_local_media_dir)


@dataclass(frozen=True)
class WorkerConfig:
    """One encoder worker: model, device and batching limits."""

    vision_model: str = "tiny"
    audio_model: str = "tiny"  # Whisper-style encoder: a preset or a local directory; "none" turns audio off
    device: str = "auto"
    dtype: str = "auto"
    max_batch_tokens: int = 32768
    max_batch_items: int = 64
    max_wait_ms: float = 2.0
    cache_bytes: int = 1 << 30  # machine-wide shared-memory embedding cache; 0 turns it off
    cache_by_url: bool = True  # also key the cache by URL (assumes a URL's content does not change)
    cache_name: str = ""  # arena name; default mmenc-cache-<model fingerprint>, shared by same-model fleets
    compile: bool = True  # torch.compile the ViT blocks; CUDA only (1.6x there), ignored on CPU

    def __post_init__(self) -> None:
        _require(self.dtype in ("auto", "float32", "bfloat16", "float16"),
                 f"dtype must be auto|float32|bfloat16|float16, got {self.dtype!r}")
        _require(self.max_batch_tokens > 0 and self.max_batch_items > 0, "batch limits must be > 0")
        _require(self.max_wait_ms >= 0, "max_wait_ms must be >= 0")
        _require(self.cache_bytes >= 0, "cache_bytes must be >= 0")
        is_preset = self.vision_model in VISION_PRESETS
        _require(is_preset or Path(self.vision_model).is_dir(),
                 f"vision_model {self.vision_model!r} is neither a preset {sorted(VISION_PRESETS)} "
                 "nor a local directory")
        _require(self.audio_model in ("none", *AUDIO_PRESETS) or Path(self.audio_model).is_dir(),
                 f"audio_model {self.audio_model!r} is neither 'none', a preset {sorted(AUDIO_PRESETS)} "
                 "nor a local directory")


@dataclass(frozen=True)
class EngineArgs:
    """The bundled prefill/decode engine behind `/v1/chat/completions` and `/v1/completions`."""

    llm: str = "tiny"  # MiMo-V2-Flash preset (`tiny`, `mid`), a save_pretrained directory, or "none" (no chat)
    llm_device: str = "auto"
    llm_dtype: str = "auto"
    llm_kv_tokens: int = 16384  # full-attention KV pool (token slots); the SWA pool is sized from the batch limits
    llm_max_num_seqs: int = 64
    llm_max_prefill_tokens: int = 512  # prefill chunk budget per step
    llm_prefix_cache: bool = True
    llm_policy: str = "fewest-uncached"  # waiting-queue order: fewest-uncached | fcfs
    llm_overlap: bool = True  # prefill text while media encodes (off: wait for every embedding, for comparison)
    max_completion_tokens: int = 4096  # per request; larger asks are refused
    engine_port: int = 0  # 0: the engine listens on a local ipc socket

    def __post_init__(self) -> None:
        from engine_link.engine.config import MODEL_PRESETS, POLICIES

        _require(self.llm in ("none", *MODEL_PRESETS) or Path(self.llm).is_dir(),
                 f"llm {self.llm!r} is neither 'none', a preset {sorted(MODEL_PRESETS)} nor a local directory")
        _require(self.llm_dtype in ("auto", "float32", "bfloat16", "float16"), f"bad llm_dtype {self.llm_dtype!r}")
        _require(self.llm_kv_tokens > 0 and self.llm_max_num_seqs > 0 and self.llm_max_prefill_tokens > 0,
                 "engine limits must be > 0")
        _require(self.llm_policy in POLICIES, f"llm_policy must be one of {POLICIES}")
        _require(self.max_completion_tokens > 0, "max_completion_tokens must be > 0")
        _require(0 <= self.engine_port < 65536, f"engine_port out of range: {self.engine_port}")

    def overrides(self) -> dict[str, Any]:
        """`EngineConfig` fields for `LLM(model, **overrides)`."""
        return dict(device=self.llm_device, dtype=self.llm_dtype, num_full_slots=self.llm_kv_tokens,
                    max_num_seqs=self.llm_max_num_seqs, max_prefill_tokens=self.llm_max_prefill_tokens,
                    enable_prefix_cache=self.llm_prefix_cache, policy=self.llm_policy)


@dataclass(frozen=True)
class ServerArgs:
    """The gateway and its limits. Nested configs are flattened into CLI flags by field name."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "mmenc-vision"
    num_workers: int = -1  # local encoder workers; -1: one per visible GPU (one on the CPU); 0: none (--encoders)
    worker_host: str = "127.0.0.1"  # with --worker-port: the interface worker endpoints bind
    worker_port: int = 0  # 0: workers listen on local ipc sockets; P: worker i on tcp://worker_host:P+i
    encoders: str = ""  # remote workers (host:port or ipc://path, ...) of `mmenc serve --worker-port` elsewhere
    route_balance: float = 1.25  # bounded loads: past this x the mean items in flight (+4), keys go to the next node
    api_processes: int = 1  # HTTP processes sharing --port (SO_REUSEPORT): >1 spreads JSON/base64 work over cores
    max_items_per_request: int = 64
    max_body_bytes: int = 64 * 1024 * 1024
    max_inflight_requests: int = 512  # beyond this the gateway answers 429 with Retry-After at once
    max_worker_items: int = 128  # items queued on one encoder worker; a request that would pass it gets a 429
    api_key: str = ""  # when set, every route but /health needs `Authorization: Bearer <api_key>`
    request_timeout_s: float = 120.0
    log_level: str = "info"
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    fetch: FetchConfig = field(default_factory=FetchConfig)
    engine: EngineArgs = field(default_factory=EngineArgs)

    def __post_init__(self) -> None:
        _require(0 <= self.port < 65536, f"port out of range: {self.port}")
        _require(self.num_workers >= -1, "num_workers must be >= -1 (-1 = one per GPU)")
        _require(self.num_workers != 0 or bool(self.encoder_addresses),
                 "num_workers 0 needs --encoders host:port,... (someone must encode)")
        _require(0 <= self.worker_port < 65536, f"worker_port out of range: {self.worker_port}")
        _require(1 <= self.api_processes <= 64, "api_processes must be in 1..64")
        _require(self.route_balance == 0 or self.route_balance >= 1, "route_balance must be 0 (off) or >= 1")
        _require(self.api_processes == 1 or self.port != 0, "api_processes > 1 needs a fixed --port (not 0)")
        for address in self.encoder_addresses:
            if address.startswith("ipc://"):  # a local worker's socket (the API front processes use these)
                _require(len(address) > len("ipc://"), f"--encoders entry {address!r} names no socket path")
                continue
            host, _, port = address.removeprefix("tcp://").rpartition(":")
            _require(bool(host) and port.isdigit() and 0 < int(port) < 65536,
                     f"--encoders entry {address!r} is not host:port")
        _require(self.max_items_per_request > 0, "max_items_per_request must be > 0")
        _require(self.max_body_bytes > 0, "max_body_bytes must be > 0")
        _require(self.max_inflight_requests > 0 and self.max_worker_items > 0,
                 "max_inflight_requests and max_worker_items must be > 0")
        _require(self.request_timeout_s > 0, "request_timeout_s must be > 0")
        _require(self.log_level in ("debug", "info", "warning", "error"), "bad log_level")

    @property
    def encoder_addresses(self) -> list[str]:
        """ZeroMQ addresses of the remote workers in `encoders` (host:port means tcp://host:port)."""
        return [a if a.startswith(("tcp://", "ipc://")) else "tcp://" + a
                for a in (x.strip() for x in self.encoders.split(",")) if a]


# --------------------------------------------------------------------------------------------- CLI


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(scalar type, is_optional) of an annotation like `int`, `str | None`, `tuple[float, ...]`."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])[0], True
    return tp, False


def add_config_args(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per field of `cls` (recursing into nested config dataclasses)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        tp, _ = _base_type(hints[f.name])
        if dataclasses.is_dataclass(tp):
            add_config_args(parser, tp, skip)
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        help_text = f"(default: {default!r})"
        if tp is bool:
            parser.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                                default=default, help=help_text)
        elif typing.get_origin(tp) is tuple:
            elem = typing.get_args(tp)[0]
            parser.add_argument(_flag(f.name), dest=f.name, type=lambda s, e=elem: tuple(e(x) for x in s.split(",")),
                                default=default, help=f"comma-separated {help_text}")
        else:
            parser.add_argument(_flag(f.name), dest=f.name, type=tp, default=default, help=help_text)


def config_from_args(cls: type, ns: argparse.Namespace) -> Any:
    """Build `cls` from parsed flags (the inverse of `add_config_args`)."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        tp, _ = _base_type(hints[f.name])
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = config_from_args(tp, ns)
        elif hasattr(ns, f.name):
            kwargs[f.name] = getattr(ns, f.name)
    return cls(**kwargs)


def config_to_json(cfg: Any) -> str:
    return json.dumps(dataclasses.asdict(cfg))


def config_from_json(cls: type, text: str) -> Any:
    return _from_dict(cls, json.loads(text))


def _from_dict(cls: type, d: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            continue
        tp, _ = _base_type(hints[f.name])
        value = d[f.name]
        if dataclasses.is_dataclass(tp):
            value = _from_dict(tp, value)
        elif typing.get_origin(tp) is tuple and value is not None:
            value = tuple(value)
        kwargs[f.name] = value
    return cls(**kwargs)



@dataclass(frozen=True)
class AudioConfig:
    """Shape of the Whisper-style audio encoder (field names follow transformers' `WhisperConfig`)."""

    num_mel_bins: int = 80
    d_model: int = 64
    encoder_layers: int = 2
    encoder_attention_heads: int = 4
    encoder_ffn_dim: int = 128
    max_source_positions: int = 1500
    activation_function: str = "gelu"
    seed: int = 0

    def __post_init__(self) -> None:
        _require(self.num_mel_bins in (80, 128), f"num_mel_bins must be 80 or 128, got {self.num_mel_bins}")
        _require(self.d_model > 0 and self.encoder_layers > 0 and self.encoder_ffn_dim > 0, "audio sizes must be > 0")
        _require(self.d_model % self.encoder_attention_heads == 0, "d_model must be divisible by the head count")
        _require(self.d_model % 2 == 0, "d_model must be even (sinusoidal positions)")
        _require(self.max_source_positions > 0, "max_source_positions must be > 0")
        _require(self.activation_function in ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu"),
                 f"unsupported activation_function {self.activation_function!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads

    @property
    def num_frames(self) -> int:
        """Mel frames per window the encoder takes (conv2 halves them): 3000 for Whisper."""
        return 2 * self.max_source_positions

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> AudioConfig:
        """Read a transformers `WhisperConfig` dict (full model or encoder-only save)."""
        return cls(
            num_mel_bins=d.get("num_mel_bins", 80), d_model=d["d_model"], encoder_layers=d["encoder_layers"],
            encoder_attention_heads=d["encoder_attention_heads"], encoder_ffn_dim=d["encoder_ffn_dim"],
            max_source_positions=d.get("max_source_positions", 1500),
            activation_function=d.get("activation_function", "gelu"),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers `WhisperConfig` keyword arguments for this encoder shape."""
        return dict(
            num_mel_bins=self.num_mel_bins, d_model=self.d_model, encoder_layers=self.encoder_layers,
            encoder_attention_heads=self.encoder_attention_heads, encoder_ffn_dim=self.encoder_ffn_dim,
            max_source_positions=self.max_source_positions, activation_function=self.activation_function,
        )


AUDIO_PRESETS: dict[str, AudioConfig] = {
    "tiny": AudioConfig(),
    "whisper-large-v3": AudioConfig(
        num_mel_bins=128, d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
    ),
}
