"""Per-request video sampling options (the keys of a qwen-vl-utils video element) within the server's limits.

A request may ask for fewer or smaller frames than the server's defaults (`PreprocessConfig.video_*`),
never more: `nframes`/`max_frames` up to `video_max_frames`, pixel budgets up to the server's. The
gateway validates (400 on anything else); the worker turns the same options into a `VideoSampling`.
"""

from __future__ import annotations

import math
from typing import Any

from encoder_server.config import PreprocessConfig
from preprocess.video_sampling import VideoSampling

# option -> (type, attribute of PreprocessConfig it may not exceed, or None)
VIDEO_OPTIONS: dict[str, tuple[type, str | None]] = {
    "fps": (float, None),
    "nframes": (int, "video_max_frames"),
    "min_frames": (int, "video_max_frames"),
    "max_frames": (int, "video_max_frames"),
    "video_start": (float, None),
    "video_end": (float, None),
    "min_pixels": (int, "video_max_pixels"),
    "max_pixels": (int, "video_max_pixels"),
    "total_pixels": (int, "video_total_pixels"),
}


MAX_OPTION_VALUE = 2**53  # larger JSON integers are refused before any float conversion


def parse_video_options(raw: dict[str, Any], prep: PreprocessConfig) -> dict[str, float | int]:
    """The known sampling options in `raw` (other keys are ignored), checked against the server's limits.

    Raises:
        ValueError: a wrong type, a non-finite or negative value, a value above the server's limit, or a
            combination `VideoSampling` refuses (e.g. `min_frames > max_frames`).
    """
    options: dict[str, float | int] = {}
    for name, (kind, limit_field) in VIDEO_OPTIONS.items():
        if name not in raw or raw[name] is None:
            continue
        value = raw[name]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name} must be a number, got {type(value).__name__}")
        if isinstance(value, int) and abs(value) > MAX_OPTION_VALUE:  # NOTE: math.isfinite(10**400) overflows
            raise ValueError(f"{name} is too large")
        if not math.isfinite(value) or value < 0 or (value == 0 and name not in ("video_start", "video_end")):
            raise ValueError(f"{name} must be {'>= 0' if name.startswith('video_') else '> 0'}, got {value}")
        if kind is int and value != int(value):  # NOTE: after the isfinite check: int(inf) overflows
            raise ValueError(f"{name} must be a whole number, got {value}")
        if limit_field is not None and value > (limit := getattr(prep, limit_field)):
            flag = "--" + limit_field.replace("_", "-")
            raise ValueError(f"{name}={value} is above this server's limit of {limit} ({flag})")
        options[name] = kind(value)
    if "fps" in options and "nframes" in options:
        raise ValueError("give fps or nframes, not both")
    sampling_for(prep, options)  # the combination must be valid too
    return options


def sampling_for(prep: PreprocessConfig, options: dict[str, float | int]) -> VideoSampling:
    """The `VideoSampling` of one video: the server's defaults overridden by the request's `options`."""
    max_pixels = min(int(options.get("max_pixels", prep.video_max_pixels)), prep.video_max_pixels)
    return VideoSampling(
        fps=float(options.get("fps", prep.video_fps)),
        nframes=int(options["nframes"]) if "nframes" in options else None,
        min_frames=int(options.get("min_frames", prep.video_min_frames)),
        max_frames=int(options.get("max_frames", prep.video_max_frames)),
        video_start=float(options["video_start"]) if "video_start" in options else None,
        video_end=float(options["video_end"]) if "video_end" in options else None,
        min_pixels=min(int(options.get("min_pixels", prep.video_min_pixels)), max_pixels),
        max_pixels=max_pixels,
        total_pixels=int(options.get("total_pixels", prep.video_total_pixels)),
        factor=prep.resize_factor,
    )
