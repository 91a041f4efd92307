"""Video: qwen-vl-utils-compatible sampling, chunked parallel decode, patchify vs transformers."""

from __future__ import annotations

import io
import math
import threading
import time
from fractions import Fraction

import decord
import numpy as np
import pytest
import torch
from transformers import Qwen2VLVideoProcessor

from encoder_server.config import PreprocessConfig
from preprocess import video_decode
from preprocess.errors import DecodeError, MediaError, MediaTooLarge
from preprocess.image import normalize_coeffs
from preprocess.video import patchify_video, preprocess_video, video_num_tokens
from preprocess.video_decode import decode_frames, plan_chunks, probe_video
from preprocess.video_sampling import VideoSampling, frame_size, sample_indices, smart_nframes
from tests.media_video import make_video

# NOTE: same float32 arithmetic difference as the image test (fused multiply-add vs transformers'
# (x - 255 * mean) / (255 * std)); measured max-abs diff 4.8e-7.
MAX_ABS_DIFF = 1e-6


@pytest.fixture(scope="module")
def hf_processor() -> Qwen2VLVideoProcessor:
    return Qwen2VLVideoProcessor()


# ---- sampling: reference values derived by hand from qwen-vl-utils' formulas ----
# nframes = floor2(clamp(frames / fps * 2, 4, floor2(min(768, frames)))), idx = round(linspace(start, end, n))

@pytest.mark.parametrize(("total_frames", "fps", "sampling", "expected"), [
    # 10 s @ 30 fps: 300 / 30 * 2 = 20 frames, step 299 / 19
    (300, 30.0, VideoSampling(),
     [0, 16, 31, 47, 63, 79, 94, 110, 126, 142, 157, 173, 189, 205, 220, 236, 252, 268, 283, 299]),
    # 3.28 s @ 25 fps (82 frames): 6.56 -> 6 frames, step 16.2
    (82, 25.0, VideoSampling(), [0, 16, 32, 49, 65, 81]),
    # 1 s @ 30 fps: 2 -> raised to the 4-frame minimum, step 29 / 3
    (30, 30.0, VideoSampling(), [0, 10, 19, 29]),
    # 3 frames: max_frames = floor2(3) = 2 caps the minimum of 4
    (3, 30.0, VideoSampling(), [0, 2]),
    # nframes override: round(5 / 2) * 2 = 4 (round half to even)
    (300, 30.0, VideoSampling(nframes=5), [0, 100, 199, 299]),
    # nframes=7 -> round(3.5) * 2 = 8
    (300, 30.0, VideoSampling(nframes=7), [0, 43, 85, 128, 171, 214, 256, 299]),
    # [2.5 s, 7 s]: frames ceil(75)..floor(210) = 136 frames -> 9.07 -> 8, step 135 / 7
    (300, 30.0, VideoSampling(video_start=2.5, video_end=7.0), [75, 94, 114, 133, 152, 171, 191, 210]),
    # from 9.5 s: frames 285..299 = 15 -> 1 -> 4 (min), step 14 / 3
    (300, 30.0, VideoSampling(video_start=9.5), [285, 290, 294, 299]),
    # fps 1 over 10 s @ 30 fps: 10 frames, step 299 / 9
    (300, 30.0, VideoSampling(fps=1.0), [0, 33, 66, 100, 133, 166, 199, 233, 266, 299]),
])
def test_sample_indices_reference(total_frames: int, fps: float, sampling: VideoSampling, expected: list[int]) -> None:
    assert sample_indices(total_frames, fps, sampling) == expected


def test_one_hour_samples_768_frames() -> None:
    idx = sample_indices(108_000, 30.0, VideoSampling())  # 1 h @ 30 fps: 7200 frames -> capped at 768
    assert len(idx) == 768
    assert idx[:4] == [0, 141, 282, 422] and idx[383:385] == [53929, 54070] and idx[-3:] == [107717, 107858, 107999]
    # NOTE: torch.linspace runs in float32 (ulp 0.0078 near 1e5), as in qwen-vl-utils; where the exact value
    # lies within 0.02 of .5 either neighbour is accepted, everywhere else the exact rounding must hold.
    for i, got in enumerate(idx):
        exact = Fraction(107_999 * i, 767)
        if abs(exact % 1 - Fraction(1, 2)) < Fraction(1, 50):
            assert got in (math.floor(exact), math.ceil(exact))
        else:
            assert got == math.floor(exact + Fraction(1, 2)), i


def test_sampling_errors() -> None:
    with pytest.raises(MediaError) as err:
        sample_indices(1, 30.0, VideoSampling())  # floor2(1) = 0 frames
    assert err.value.status == 400 and err.value.code == "bad_video_frames"
    with pytest.raises(MediaError) as err:
        sample_indices(300, 30.0, VideoSampling(video_start=9.99))  # ceil(299.7) = 300 > 299
    assert err.value.code == "bad_video_range"
    with pytest.raises(MediaError):
        smart_nframes(10, 30.0, VideoSampling(nframes=12))  # more than the clip holds
    with pytest.raises(ValueError):
        VideoSampling(fps=0)


@pytest.mark.parametrize(("height", "width", "nframes", "sampling", "expected"), [
    # budget min(768 * 784, 90316800 / 20 * 2) = 602112; beta = sqrt(921600 / 602112) -> floor to 28
    (720, 1280, 20, VideoSampling(), (560, 1008)),
    # 768 frames: 90316800 / 768 * 2 = 235200 per frame
    (720, 1280, 768, VideoSampling(), (336, 644)),
    # explicit max_pixels below the budget
    (720, 1280, 20, VideoSampling(max_pixels=235200), (336, 644)),
    # tiny total_pixels: floor of int(128 * 784 * 1.05) = 105369 (the result may fall below min_pixels)
    (720, 1280, 20, VideoSampling(total_pixels=401408), (224, 420)),
    # small frames are scaled up to min_pixels = 100352: beta = sqrt(100352 / 3072) -> ceil to 28
    (48, 64, 4, VideoSampling(), (280, 392)),
])
def test_frame_size_reference(height: int, width: int, nframes: int, sampling: VideoSampling,
                              expected: tuple[int, int]) -> None:
    assert frame_size(height, width, nframes, sampling) == expected


@pytest.mark.parametrize(("num_frames", "height", "width"), [(4, 48, 64), (20, 720, 1280), (300, 72, 128),
                                                         (6, 100, 3000), (768, 30, 40)])
def test_frame_size_matches_transformers_capped(hf_processor: Qwen2VLVideoProcessor, num_frames: int, height: int,
                                                width: int) -> None:
    """transformers' `cap_pixels_per_frame=True` is its port of the same qwen-vl-utils budget."""
    frames = torch.zeros((num_frames, 3, height, width), dtype=torch.uint8)
    grid = hf_processor(videos=[frames], cap_pixels_per_frame=True, return_tensors="pt")["video_grid_thw"][0]
    h, w = frame_size(height, width, num_frames, VideoSampling())
    assert grid.tolist() == [-(-num_frames // 2), h // 14, w // 14]


# ---- decode ----

@pytest.fixture(scope="module")
def video_bytes() -> bytes:
    return make_video(num_frames=240, fps=30, width=64, height=48, gop=12)  # keyframes every 12 frames


def _sequential(src: bytes, indices: list[int]) -> np.ndarray:
    return decord.VideoReader(io.BytesIO(src), num_threads=1).get_batch(indices).asnumpy()  # [T, H, W, 3]


def test_probe(video_bytes: bytes) -> None:
    info = probe_video(video_bytes)
    assert (info.num_frames, info.fps, info.height, info.width) == (240, 30.0, 48, 64)
    assert info.key_indices == tuple(range(0, 240, 12)) and info.duration_s == 8.0


@pytest.mark.parametrize("num_chunks", [1, 2, 3, 5, 8, 64])
def test_parallel_decode_bit_identical(video_bytes: bytes, num_chunks: int) -> None:
    for indices in (sample_indices(240, 30.0, VideoSampling()), [0, 5, 13, 30, 31, 31, 100, 150, 239],
                    sample_indices(240, 30.0, VideoSampling(nframes=240))):
        frames = decode_frames(video_bytes, indices, num_chunks=num_chunks, deadline_s=30)
        assert frames.dtype == torch.uint8 and frames.shape == (len(indices), 48, 64, 3)
        assert np.array_equal(frames.numpy(), _sequential(video_bytes, indices))


def test_decode_from_path(video_bytes: bytes, tmp_path) -> None:
    path = tmp_path / "clip.mp4"
    path.write_bytes(video_bytes)
    indices = [1, 50, 51, 200]
    assert np.array_equal(decode_frames(str(path), indices, num_chunks=3).numpy(), _sequential(video_bytes, indices))


def test_end_to_end_sampling_on_real_video() -> None:
    src = make_video(num_frames=82, fps=25, gop=10)
    info = probe_video(src)
    indices = sample_indices(info.num_frames, info.fps, VideoSampling())
    assert indices == [0, 16, 32, 49, 65, 81]
    assert np.array_equal(decode_frames(src, indices, num_chunks=4).numpy(), _sequential(src, indices))


def test_plan_chunks_keyframe_aligned_and_balanced() -> None:
    keys = list(range(0, 1000, 10))
    indices = list(range(0, 1000, 3))
    for num_chunks in (1, 2, 4, 7, 16, 1000):
        chunks = plan_chunks(indices, keys, num_chunks)
        assert [i for c in chunks for i in c] == indices
        assert 1 <= len(chunks) <= num_chunks and all(chunks)
        gops = [{i // 10 for i in c} for c in chunks]
        assert all(not (a & b) for a, b in zip(gops, gops[1:], strict=False))  # no GOP in two chunks
    sizes = [len(c) for c in plan_chunks(indices, keys, 4)]
    assert len(sizes) == 4 and max(sizes) - min(sizes) <= 4  # 100 GOPs of equal cost: 25 each
    # one GOP-heavy region: cost counts decoded frames (from the keyframe), not sampled frames
    chunks = plan_chunks([5, 15, 25, 35, 999], [0, 10, 20, 30, 40], 2)
    assert chunks == [[5, 15, 25, 35], [999]]
    assert plan_chunks([], keys, 4) == []


def test_decode_deadline(video_bytes: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def stuck(src: bytes, indices: list[int]) -> np.ndarray:  # a decord hang
        release.wait(10)
        raise RuntimeError("released")

    monkeypatch.setattr(video_decode, "_decode_chunk", stuck)
    start = time.monotonic()
    try:
        with pytest.raises(MediaError) as err:
            decode_frames(video_bytes, [0, 100, 200], num_chunks=3, deadline_s=0.3)
    finally:
        release.set()
    assert time.monotonic() - start < 2.0
    assert err.value.status == 422 and err.value.code == "decode_timeout"


def test_probe_deadline(video_bytes: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    monkeypatch.setattr(video_decode, "_probe", lambda src: release.wait(10))  # hangs while opening
    try:
        with pytest.raises(MediaError) as err:
            decode_frames(video_bytes, [0, 1], deadline_s=0.2)  # no key_indices: probes first
        assert err.value.code == "decode_timeout"
        with pytest.raises(MediaError):
            probe_video(video_bytes, deadline_s=0.2)
    finally:
        release.set()


def test_chunk_failure_is_decode_error(video_bytes: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(src: bytes, indices: list[int]) -> np.ndarray:
        raise RuntimeError("[12:00:00] decord/src/video/video_reader.cc:1: ERROR\nstack...")

    monkeypatch.setattr(video_decode, "_decode_chunk", broken)
    with pytest.raises(DecodeError, match="decord/src/video") as err:
        decode_frames(video_bytes, [0, 100], num_chunks=2, key_indices=(0, 12, 96))
    assert "stack" not in err.value.message


@pytest.mark.parametrize("data", [b"", b"this is not a video" * 50, b"\x00" * 4096])
def test_bad_bytes(data: bytes) -> None:
    with pytest.raises(DecodeError) as err:
        probe_video(data)
    assert err.value.status == 415
    with pytest.raises(DecodeError):
        decode_frames(data, [0, 1])


def test_truncated_video(video_bytes: bytes) -> None:
    truncated = video_bytes[: len(video_bytes) // 2]  # PyAV writes the index (moov) at the end
    with pytest.raises(DecodeError):
        probe_video(truncated)
    with pytest.raises(DecodeError):
        decode_frames(truncated, [0, 100], num_chunks=2, key_indices=(0, 96))


def test_too_long(video_bytes: bytes) -> None:
    assert probe_video(video_bytes, max_duration_s=8.0).num_frames == 240
    with pytest.raises(MediaTooLarge) as err:
        probe_video(video_bytes, max_duration_s=7.5)
    assert err.value.status == 413


# ---- patchify ----

@pytest.mark.parametrize(("num_frames", "height", "width"), [(4, 56, 84), (5, 56, 84), (1, 28, 28), (7, 112, 56)])
def test_patchify_matches_transformers(hf_processor: Qwen2VLVideoProcessor, num_frames: int, height: int,
                                       width: int) -> None:
    gen = torch.Generator().manual_seed(num_frames * 1000 + height + width)
    frames = torch.randint(0, 256, (num_frames, 3, height, width), dtype=torch.uint8, generator=gen)  # [T, 3, H, W]
    ref = hf_processor(videos=[frames], do_resize=False, return_tensors="pt")
    cfg = PreprocessConfig()
    scale, bias = normalize_coeffs(cfg, torch.device("cpu"))
    pixel_values, grid_thw = patchify_video(torch.addcmul(bias, frames, scale), 14, 2, 2)
    assert grid_thw.tolist() == ref["video_grid_thw"][0].tolist() == [-(-num_frames // 2), height // 14, width // 14]
    assert pixel_values.shape == ref["pixel_values_videos"].shape
    assert (pixel_values - ref["pixel_values_videos"]).abs().max().item() <= MAX_ABS_DIFF


def test_odd_frames_repeat_last() -> None:
    frames = torch.arange(3 * 3 * 28 * 28, dtype=torch.float32).reshape(3, 3, 28, 28)  # [T=3, C, h, w]
    padded = torch.cat([frames, frames[-1:]])
    assert torch.equal(patchify_video(frames, 14, 2, 2)[0], patchify_video(padded, 14, 2, 2)[0])


def test_preprocess_video_end_to_end(video_bytes: bytes, hf_processor: Qwen2VLVideoProcessor) -> None:
    cfg, sampling = PreprocessConfig(), VideoSampling()
    indices = sample_indices(240, 30.0, sampling)  # 16 frames
    frames = decode_frames(video_bytes, indices, num_chunks=2)  # [16, 48, 64, 3]
    out = preprocess_video(frames, cfg, sampling, "cpu", channels_last=True)
    h, w = frame_size(48, 64, 16, sampling)  # (280, 392)
    assert out.grid_thw.tolist() == [8, h // 14, w // 14] and out.pixel_values.shape == (out.seq_len, 1176)
    assert video_num_tokens(16, 48, 64, cfg, sampling) == out.seq_len // 4
    # the same resized frames through transformers' patchify/normalize
    from torchvision.transforms.v2 import functional as tvF
    resized = tvF.resize(frames.permute(0, 3, 1, 2).contiguous(), [h, w],
                         interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
    ref = hf_processor(videos=[resized], do_resize=False, return_tensors="pt")
    assert (out.pixel_values - ref["pixel_values_videos"]).abs().max().item() <= MAX_ABS_DIFF
