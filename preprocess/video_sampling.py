"""Video frame sampling and per-frame size, compatible with qwen-vl-utils' `fetch_video`.

Our own implementation of the documented qwen-vl-utils behaviour (`smart_nframes`,
`calculate_video_frame_range`, the decord reader's `linspace(...).round()` indices and the pixel budget
of `fetch_video`); qwen-vl-utils itself is not a dependency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from preprocess.errors import MediaError
from preprocess.image import smart_resize

FRAME_FACTOR = 2
FPS = 2.0
FPS_MIN_FRAMES = 4
FPS_MAX_FRAMES = 768
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
VIDEO_TOTAL_PIXELS = int(128000 * 28 * 28 * 0.9)  # qwen-vl-utils' default (its env var unset)


def round_by_factor(x: float, factor: int) -> int:
    return round(x / factor) * factor


def ceil_by_factor(x: float, factor: int) -> int:
    return math.ceil(x / factor) * factor


def floor_by_factor(x: float, factor: int) -> int:
    return math.floor(x / factor) * factor


@dataclass(frozen=True)
class VideoSampling:
    """How frames are picked and how large each becomes (the keys of a qwen-vl-utils video element).

    `nframes` (a fixed count, rounded to `FRAME_FACTOR`) and `fps` are exclusive; `nframes=None` samples
    at `fps` within [min_frames, max_frames]. `video_start`/`video_end` are seconds. `max_pixels=None`
    means the budget derived from `total_pixels`.
    """

    fps: float = FPS
    nframes: int | None = None
    min_frames: int = FPS_MIN_FRAMES
    max_frames: int = FPS_MAX_FRAMES
    video_start: float | None = None
    video_end: float | None = None
    min_pixels: int = VIDEO_MIN_PIXELS
    max_pixels: int | None = None
    total_pixels: int = VIDEO_TOTAL_PIXELS
    factor: int = 28  # patch_size * merge_size

    def __post_init__(self) -> None:
        if self.fps <= 0:
            raise ValueError(f"fps must be > 0, got {self.fps}")
        if self.nframes is not None and self.nframes < 1:
            raise ValueError(f"nframes must be >= 1, got {self.nframes}")
        if not 0 < self.min_frames <= self.max_frames:
            raise ValueError("need 0 < min_frames <= max_frames")
        if self.min_pixels <= 0 or self.total_pixels <= 0:
            raise ValueError("min_pixels and total_pixels must be > 0")


def frame_range(total_frames: int, video_fps: float, sampling: VideoSampling) -> tuple[int, int, int]:
    """(start_frame, end_frame, num_frames) of the clip `[video_start, video_end]`, both ends inclusive.

    Raises:
        MediaError: (400, `bad_video_range`) when the range holds at most one frame.
    """
    if sampling.video_start is None and sampling.video_end is None:
        return 0, total_frames - 1, total_frames
    max_duration = total_frames / video_fps
    start_frame = 0
    if sampling.video_start is not None:
        start_frame = math.ceil(max(0.0, min(sampling.video_start, max_duration)) * video_fps)
    end_frame = total_frames - 1
    if sampling.video_end is not None:
        end_frame = min(math.floor(max(0.0, min(sampling.video_end, max_duration)) * video_fps), total_frames - 1)
    if start_frame >= end_frame:
        raise MediaError(f"video range [{sampling.video_start}, {sampling.video_end}] s holds no frames "
                         f"(video: {total_frames} frames at {video_fps:g} fps)", code="bad_video_range")
    return start_frame, end_frame, end_frame - start_frame + 1


def smart_nframes(total_frames: int, video_fps: float, sampling: VideoSampling) -> int:
    """Frames to sample from a clip of `total_frames` frames: a multiple of `FRAME_FACTOR`.

    Raises:
        MediaError: (400, `bad_video_frames`) when the count is outside [FRAME_FACTOR, total_frames].
    """
    if sampling.nframes is not None:
        nframes = round_by_factor(sampling.nframes, FRAME_FACTOR)
    else:
        min_frames = ceil_by_factor(sampling.min_frames, FRAME_FACTOR)
        max_frames = floor_by_factor(min(sampling.max_frames, total_frames), FRAME_FACTOR)
        nframes = total_frames / video_fps * sampling.fps
        nframes = min(min(max(nframes, min_frames), max_frames), total_frames)
        nframes = floor_by_factor(nframes, FRAME_FACTOR)
    if not FRAME_FACTOR <= nframes <= total_frames:
        raise MediaError(f"cannot sample {nframes} frames from a clip of {total_frames} frames "
                         f"(need {FRAME_FACTOR}..{total_frames})", code="bad_video_frames")
    return nframes


def sample_indices(total_frames: int, video_fps: float, sampling: VideoSampling) -> list[int]:
    """Frame indices to decode, as qwen-vl-utils' decord reader: `linspace(start, end, n).round()`.

    Args:
        total_frames: frames in the whole video.
        video_fps: its average frame rate.
        sampling: what to sample.
    Returns:
        `nframes` sorted indices within the clip (`nframes` <= clip frames, so repeats are rare).
    """
    if total_frames < 1 or video_fps <= 0:
        raise MediaError(f"video has {total_frames} frames at {video_fps:g} fps", code="bad_video_frames")
    start, end, num_frames = frame_range(total_frames, video_fps, sampling)
    nframes = smart_nframes(num_frames, video_fps, sampling)
    return torch.linspace(start, end, nframes).round().long().tolist()


def sample_fps(num_sampled: int, total_frames: int, video_fps: float) -> float:
    """Frame rate of the sampled frames, as qwen-vl-utils returns it (feeds temporal position ids)."""
    return num_sampled / max(total_frames, 1e-6) * video_fps


def frame_size(height: int, width: int, nframes: int, sampling: VideoSampling) -> tuple[int, int]:
    """Size every sampled frame is resized to: `smart_resize` under the per-frame pixel budget.

    The budget is qwen-vl-utils' `max(min(VIDEO_MAX_PIXELS, total_pixels / nframes * FRAME_FACTOR),
    int(min_pixels * 1.05))`, lowered further by an explicit `sampling.max_pixels`.

    Raises:
        MediaError: aspect ratio above 200 or an empty frame.
    """
    max_pixels = max(min(VIDEO_MAX_PIXELS, sampling.total_pixels / nframes * FRAME_FACTOR),
                     int(sampling.min_pixels * 1.05))
    if sampling.max_pixels is not None:
        max_pixels = min(sampling.max_pixels, max_pixels)
    # NOTE: qwen-vl-utils truncates the budget to int before smart_resize (beta depends on it)
    return smart_resize(height, width, factor=sampling.factor, min_pixels=sampling.min_pixels,
                        max_pixels=int(max_pixels))
