"""Video and audio reading as a fetch process runs it: bytes -> sampled frames / 16 kHz waveform.

Video decoders: decord on keyframe-aligned CPU chunks (default; frames bit-identical to a sequential read),
or DALI decoders (NVDEC on a GPU) alone or beside the CPU chunks (`preprocess.video_dali`; colours differ
from decord's by a few levels).

Images have their own path in `fetch_pool` (header check, then PIL or the GPU). Here the limits that
protect the worker are checked from the container header before anything big is decoded: duration,
frame size, and the bytes the sampled frames will take.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from preprocess.audio import decode_audio
from preprocess.errors import MediaTooLarge
from preprocess.video_decode import decode_frames, probe_video
from preprocess.video_sampling import VideoSampling, sample_fps, sample_indices


@dataclass(frozen=True)
class VideoRead:
    """How one video is sampled and decoded, and the limits it must stay within."""

    sampling: VideoSampling
    num_threads: int = 8  # parallel chunk decoders (CPU)
    backend: str = "decord"  # "decord" (CPU chunks), "dali" (DALI decoders only), "hybrid" (CPU + DALI side by side)
    num_dali: int = 2  # DALI decoders for "dali" / "hybrid"
    device_id: int | None = None  # CUDA device of the DALI decoders (NVDEC); None: DALI's CPU decoder
    max_duration_s: float = 3 * 3600.0
    max_frame_pixels: int = 64_000_000  # width * height of the source
    max_frame_bytes: int = 4 << 30  # the sampled frames, decoded (T * H * W * 3)
    deadline_s: float = 120.0  # probe + decode


@dataclass(frozen=True)
class AudioRead:
    max_duration_s: float = 3600.0


@dataclass(frozen=True)
class VideoFrames:
    frames: torch.Tensor  # uint8 [T, H, W, 3], the sampled frames at source size
    fps: float  # frame rate of the sampled frames (qwen-vl-utils' `sample_fps`)
    source_frames: int
    source_fps: float


def read_video(data: bytes, spec: VideoRead) -> VideoFrames:
    """Probe, check limits, sample indices, decode them in keyframe-aligned parallel chunks.

    Raises:
        DecodeError: (415) not a decodable video; MediaTooLarge: (413) too long, frames too large, or the
        sampled frames above `max_frame_bytes`; MediaError: (400) a sampling request the video cannot meet,
        (422 `decode_timeout`) past the deadline.
    """
    deadline = time.monotonic() + spec.deadline_s
    info = probe_video(data, spec.max_duration_s, spec.deadline_s)
    if info.height * info.width > spec.max_frame_pixels:
        raise MediaTooLarge(f"video frames are {info.width}x{info.height}, above the limit of "
                            f"{spec.max_frame_pixels} pixels")
    indices = sample_indices(info.num_frames, info.fps, spec.sampling)
    num_bytes = len(indices) * info.height * info.width * 3
    if num_bytes > spec.max_frame_bytes:
        raise MediaTooLarge(f"{len(indices)} sampled {info.width}x{info.height} frames take {num_bytes >> 20} MiB "
                            f"decoded, above the limit of {spec.max_frame_bytes >> 20} MiB; sample fewer frames")
    remaining = max(0.001, deadline - time.monotonic())
    if spec.backend == "decord":
        frames = decode_frames(data, indices, num_chunks=spec.num_threads, deadline_s=remaining,
                               key_indices=info.key_indices)  # [T, H, W, 3]
    else:
        from preprocess.video_dali import decode_frames_hybrid

        num_cpu = spec.num_threads if spec.backend == "hybrid" else 0
        frames = decode_frames_hybrid(data, indices, info.key_indices, num_cpu, spec.num_dali, spec.device_id,
                                      deadline_s=remaining).cpu()  # [T, H, W, 3]
    return VideoFrames(frames, sample_fps(len(indices), info.num_frames, info.fps), info.num_frames, info.fps)


def read_audio(data: bytes, spec: AudioRead) -> torch.Tensor:
    """Mono float32 `[N]` at 16 kHz (see `preprocess.audio.decode_audio` for the errors)."""
    return decode_audio(data, spec.max_duration_s).waveform
