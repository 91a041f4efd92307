"""Per-request video options within the server's limits, and the audio token arithmetic."""

from __future__ import annotations

import pytest

from encoder_server.config import PreprocessConfig
from encoder_server.encode_inputs import audio_window_tokens
from encoder_server.video_options import parse_video_options, sampling_for

PREP = PreprocessConfig()


def test_defaults_are_the_servers() -> None:
    sampling = sampling_for(PREP, {})
    assert (sampling.fps, sampling.nframes, sampling.max_frames) == (2.0, None, 768)
    assert sampling.max_pixels == PREP.video_max_pixels and sampling.factor == 28


def test_known_options_are_kept_and_typed_unknown_ignored() -> None:
    got = parse_video_options({"fps": 1, "video_start": 0, "video_end": 4.5, "max_pixels": 50000, "url": "x"}, PREP)
    assert got == {"fps": 1.0, "video_start": 0.0, "video_end": 4.5, "max_pixels": 50000}
    assert sampling_for(PREP, got).min_pixels == 50000  # the floor never exceeds the asked ceiling


@pytest.mark.parametrize(("raw", "message"), [
    ({"nframes": 769}, "above this server's limit of 768 (--video-max-frames)"),
    ({"total_pixels": PREP.video_total_pixels + 1}, "--video-total-pixels"),
    ({"fps": "2"}, "fps must be a number"),
    ({"fps": True}, "fps must be a number"),
    ({"nframes": 2.5}, "whole number"),
    ({"fps": 0}, "fps must be > 0"),
    ({"fps": float("nan")}, "fps must be > 0"),
    ({"video_start": -1}, "video_start must be >= 0"),
    ({"fps": 1, "nframes": 4}, "not both"),
    ({"min_frames": 8, "max_frames": 4}, "min_frames <= max_frames"),
])
def test_bad_options_are_refused_with_a_reason(raw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_video_options(raw, PREP)


@pytest.mark.parametrize(("samples", "expected"), [
    (0, [1]), (1, [1]), (160, [1]), (161, [1]), (321, [2]), (16000 * 3, [150]),
    (480000, [1500]), (480001, [1500, 1]), (16000 * 65, [1500, 1500, 250]),
])
def test_audio_window_tokens(samples: int, expected: list[int]) -> None:
    assert audio_window_tokens(samples, 1500) == expected
