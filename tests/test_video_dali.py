"""preprocess.video_dali: DALI's video decoder (CPU here, NVDEC where CUDA is) against decord, and the CPU+DALI
chunk queue.

DALI's CPU decoder takes VP8/VP9/MJPEG only, so the CPU tests decode VP9. Its YUV->RGB conversion is not
decord's (swscale): flat areas agree within rounding (median absolute difference 1 level), chroma edges differ
more (up to ~70 levels on the testsrc bars; mean 3.5 levels at 128x96, 2.2 at 256x192), so frames are not
compared bit for bit but by median (<= 2) and mean (<= 5) absolute difference, and by which decord frame each
one is closest to (it must be the requested one).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from preprocess.errors import DecodeError
from preprocess.video_decode import decode_frames, probe_video
from tests.media_video import make_video

HAS_DALI = importlib.util.find_spec("nvidia.dali") is not None
needs_dali = pytest.mark.skipif(not HAS_DALI, reason="needs nvidia-dali")
MAX_MEDIAN_ABS_DIFF = 2.0
MAX_MEAN_ABS_DIFF = 5.0


@pytest.fixture(scope="module")
def vp9() -> bytes:
    """48 VP9 frames (128x96, 24 fps, a keyframe every 12), made with PyAV in a child process.

    NOTE: once decord is loaded (other tests import it), its FFmpeg symbols shadow PyAV's and PyAV can no
    longer open the libvpx encoder; a fresh interpreter has no decord.
    """
    code = ("import sys; from bench.media_make import encode_clip; "
            "sys.stdout.buffer.write(encode_clip(48, 128, 96, 24, codec='libvpx-vp9', container='webm', crf=20, "
            "gop=12))")
    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=60, cwd=root).stdout


def _assert_close_and_right_frames(frames: torch.Tensor, data: bytes, indices: list[int]) -> None:
    everything = decode_frames(data, list(range(probe_video(data).num_frames))).float()  # [N, H, W, 3]
    assert frames.shape == (len(indices), *everything.shape[1:]) and frames.dtype == torch.uint8
    for frame, index in zip(frames.float(), indices, strict=True):
        distance = (everything - frame).abs().mean(dim=(1, 2, 3))  # [N]
        assert distance[index] <= MAX_MEAN_ABS_DIFF, (index, distance[index].item())
        assert (everything[index] - frame).abs().median() <= MAX_MEDIAN_ABS_DIFF
        assert int(distance.argmin()) == index


def test_dali_is_imported_lazily() -> None:
    import ast

    import preprocess.video_dali as module

    tree = ast.parse(Path(module.__file__).read_text())
    top_level = [alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names]
    top_level += [node.module or "" for node in tree.body if isinstance(node, ast.ImportFrom)]
    assert top_level and not any(name.startswith("nvidia") for name in top_level)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
@needs_dali
def test_gpu_decoding_without_cuda_is_a_clear_error() -> None:
    from preprocess.video_dali import decode_frames_dali, decode_frames_hybrid

    data = make_video(num_frames=8, gop=4)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        decode_frames_dali(data, [0, 1], device_id=0)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        decode_frames_hybrid(data, [0, 1], [0, 4], num_cpu=1, num_gpu=1, device_id=0)


@needs_dali
def test_dali_cpu_decoder_matches_decord(vp9: bytes) -> None:
    from preprocess.video_dali import decode_frames_dali

    for indices in ([0, 5, 13, 13, 30, 47], [47, 3, 24]):  # repeats and any order
        _assert_close_and_right_frames(decode_frames_dali(vp9, indices, device_id=None), vp9, indices)


@needs_dali
def test_dali_errors_name_the_problem(vp9: bytes) -> None:
    from preprocess.video_dali import decode_frames_dali

    with pytest.raises(DecodeError, match="out-of-bounds frame index 48"):
        decode_frames_dali(vp9, [0, 48], device_id=None)
    with pytest.raises(DecodeError, match="VP8/VP9/MJPEG"):  # H.264 needs NVDEC
        decode_frames_dali(make_video(num_frames=8, gop=4), [0], device_id=None)
    with pytest.raises(DecodeError, match="empty"):
        decode_frames_dali(b"", [0], device_id=None)
    assert decode_frames_dali(vp9, [1, 2], device_id=None).shape[0] == 2  # the pipeline was rebuilt


def test_hybrid_cpu_workers_are_bit_identical() -> None:
    from preprocess.video_dali import decode_frames_hybrid

    data = make_video(num_frames=96, gop=8)
    info = probe_video(data)
    indices = [0, 1, 7, 9, 20, 33, 34, 50, 64, 65, 80, 95]
    out = decode_frames_hybrid(data, indices, info.key_indices, num_cpu=3, num_gpu=0, chunks_per_worker=3)
    assert torch.equal(out, decode_frames(data, indices))  # readers reused across chunks: still exact
    with pytest.raises(ValueError):
        decode_frames_hybrid(data, indices, info.key_indices, num_cpu=0, num_gpu=0)
    with pytest.raises(ValueError):
        decode_frames_hybrid(data, [5, 1], info.key_indices, num_cpu=1, num_gpu=0)


@needs_dali
def test_hybrid_with_dali_cpu_workers(vp9: bytes) -> None:
    from preprocess.video_dali import decode_frames_hybrid

    info = probe_video(vp9)
    indices = list(range(0, 48, 3))
    for num_cpu, num_gpu in [(0, 2), (2, 2)]:
        out = decode_frames_hybrid(vp9, indices, info.key_indices, num_cpu, num_gpu, device_id=None)
        _assert_close_and_right_frames(out, vp9, indices)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@needs_dali
def test_nvdec_matches_decord() -> None:
    from bench.media_make import encode_clip
    from preprocess.video_dali import decode_frames_dali, decode_frames_hybrid

    data = encode_clip(96, 256, 192, 24, crf=20, gop=8)  # H.264, SD size: BT.601 for decord and NVDEC alike
    indices = [0, 5, 13, 13, 30, 47, 95]
    frames = decode_frames_dali(data, indices, device_id=0)
    assert frames.device.type == "cuda"
    _assert_close_and_right_frames(frames.cpu(), data, indices)
    info = probe_video(data)
    sorted_indices = sorted(set(indices))
    out = decode_frames_hybrid(data, sorted_indices, info.key_indices, num_cpu=2, num_gpu=2, device_id=0)
    assert out.device.type == "cuda"
    _assert_close_and_right_frames(out.cpu(), data, sorted_indices)


@needs_dali
@pytest.mark.parametrize("backend", ["dali", "hybrid"])
def test_read_video_with_a_dali_backend(vp9: bytes, backend: str) -> None:
    """The fetch processes' `read_video` with `--video-decode-backend dali|hybrid` (DALI's CPU decoder here)."""
    from preprocess.media_read import VideoRead, read_video
    from preprocess.video_sampling import VideoSampling, sample_indices

    spec = VideoRead(VideoSampling(nframes=8), num_threads=2, backend=backend, num_dali=1, device_id=None)
    video = read_video(vp9, spec)
    indices = sample_indices(48, 24.0, VideoSampling(nframes=8))
    assert video.frames.shape == (8, 96, 128, 3) and video.frames.device.type == "cpu"
    _assert_close_and_right_frames(video.frames, vp9, indices)
