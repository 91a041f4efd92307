"""Chunked parallel video decoding with decord, bounded by a deadline.

The sampled indices are split into chunks whose boundaries fall on keyframes (no GOP is decoded by two
chunks) and whose decode work is balanced; each chunk is decoded by its own `VideoReader(num_threads=1)`
on its own daemon thread. decord calls go through ctypes, which releases the GIL, so chunks decode in
parallel. Output frames are bit-identical to one sequential `get_batch` over all indices.

NOTE: decord can hang on pathological input and a thread cannot be killed. When the deadline passes we
stop waiting and raise; a stuck chunk thread is abandoned (daemon: it does not block interpreter exit)
and keeps its CPU and memory until decord returns. Callers that need hard isolation run this in a
fetch-pool process and recycle the process after a timeout.
"""

from __future__ import annotations

import io
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from preprocess.errors import DecodeError, MediaError, MediaTooLarge

VideoSource = str | bytes
T = TypeVar("T")
MAX_CONTAINER_FRAMES = 1 << 24  # 3 days at 60 fps; an MP4 video track claiming more is refused


@dataclass(frozen=True)
class VideoInfo:
    """What the container says about a video."""

    num_frames: int
    fps: float
    height: int
    width: int
    key_indices: tuple[int, ...]  # sorted frame indices of keyframes

    @property
    def duration_s(self) -> float:
        return self.num_frames / self.fps


def _open(src: VideoSource):  # -> decord.VideoReader
    """One `VideoReader(num_threads=1)` on a path or on in-memory bytes; bad data -> DecodeError."""
    import decord

    if isinstance(src, bytes | bytearray | memoryview) and len(src) == 0:
        raise DecodeError("video is empty (0 bytes)", code="empty_video")
    if not isinstance(src, str):
        check_mp4_sample_tables(bytes(src))
    try:
        return decord.VideoReader(io.BytesIO(src) if not isinstance(src, str) else src, num_threads=1)
    except Exception as exc:  # decord raises DECORDError / RuntimeError for anything FFmpeg rejects
        raise DecodeError(f"cannot decode video: {_short(exc)}") from exc


def check_mp4_sample_tables(data: bytes) -> None:
    """Refuse an MP4/MOV whose sample tables claim what the file cannot hold, before decord opens it.

    NOTE: decord 0.6 kills the process on such a file instead of raising: a video `stts` claiming >= 2**30
    frames aborts it (std::bad_alloc), an `stsz` uniform sample size of 10 MB in a 2 KB file segfaults it.

    Raises:
        DecodeError: (415) a video track of more than `MAX_CONTAINER_FRAMES` frames, or samples larger than
            the file.
    """
    if data[4:8] not in (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip"):
        return  # not ISO base media: other containers go to decord as they are
    for moov in _mp4_boxes(data, 0, len(data), b"moov"):
        for trak in _mp4_boxes(data, *moov, b"trak"):
            for mdia in _mp4_boxes(data, *trak, b"mdia"):
                is_video = any(data[body + 8:body + 12] == b"vide" for body, _ in _mp4_boxes(data, *mdia, b"hdlr"))
                for minf in _mp4_boxes(data, *mdia, b"minf"):
                    for stbl in _mp4_boxes(data, *minf, b"stbl"):
                        for body, end in _mp4_boxes(data, *stbl, b"stts"):
                            if is_video and body + 8 <= end:  # version/flags, entry count, (count, delta) pairs
                                _check_frame_count(data, body)
                        for body, end in _mp4_boxes(data, *stbl, b"stsz"):
                            if body + 12 <= end:  # version/flags, uniform sample size, sample count
                                sample_size, num_samples = struct.unpack_from(">II", data, body + 4)
                                if sample_size * num_samples > len(data):
                                    raise DecodeError(f"video container claims {num_samples} samples of "
                                                      f"{sample_size} bytes in a {len(data)}-byte file")


def _check_frame_count(data: bytes, stts_body: int) -> None:
    # NOTE: FFmpeg reads all the entries the count claims, past the box's end if need be
    num_entries = min(struct.unpack_from(">I", data, stts_body + 4)[0], (len(data) - stts_body - 8) // 8)
    counts = np.frombuffer(data, ">u4", 2 * num_entries, stts_body + 8)[0::2]
    if (num_frames := int(counts.sum(dtype=np.int64))) > MAX_CONTAINER_FRAMES:
        raise DecodeError(f"video container claims {num_frames} frames; the limit is {MAX_CONTAINER_FRAMES}")


def _mp4_boxes(data: bytes, pos: int, end: int, kind: bytes) -> Iterator[tuple[int, int]]:
    """(body start, body end) of each box of type `kind` directly inside `data[pos:end]`."""
    while pos + 8 <= end:
        size, box = struct.unpack_from(">I4s", data, pos)
        header = 8
        if size == 1 and pos + 16 <= end:  # a 64-bit size follows
            size, header = struct.unpack_from(">Q", data, pos + 8)[0], 16
        elif size == 0:  # to the end
            size = end - pos
        if size < header:
            return
        if box == kind:
            yield pos + header, min(pos + size, end)
        pos += size


def probe_video(src: VideoSource, max_duration_s: float | None = None, deadline_s: float | None = None) -> VideoInfo:
    """Open a video and read its frame count, frame rate, size and keyframes.

    Args:
        src: a local path or the file's bytes.
        max_duration_s: longest accepted duration (None: no limit).
        deadline_s: seconds the probe may take (None: no limit).
    Returns:
        The `VideoInfo`.
    Raises:
        DecodeError: (415) empty, corrupt or non-video bytes, or a video without frames.
        MediaTooLarge: (413) longer than `max_duration_s`.
        MediaError: (422, `decode_timeout`) the probe took longer than `deadline_s`.
    """
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    (info,) = _run_all([lambda: _probe(src)], deadline, deadline_s)
    if max_duration_s is not None and info.duration_s > max_duration_s:
        raise MediaTooLarge(f"video lasts {info.duration_s:.1f} s, above the limit of {max_duration_s:g} s")
    return info


def _probe(src: VideoSource) -> VideoInfo:
    """Read the `VideoInfo` with one reader (runs on a worker thread)."""
    reader = _open(src)
    num_frames, fps = len(reader), float(reader.get_avg_fps())
    if num_frames < 1 or not fps > 0:
        raise DecodeError(f"video has {num_frames} frames at {fps:g} fps", code="empty_video")
    height, width = reader.next().shape[:2]
    return VideoInfo(num_frames, fps, int(height), int(width), tuple(sorted(int(k) for k in reader.get_key_indices())))


def plan_chunks(indices: list[int], key_indices: tuple[int, ...] | list[int], num_chunks: int) -> list[list[int]]:
    """Split sorted frame indices into at most `num_chunks` runs that start on GOP boundaries.

    All indices inside one GOP stay in one chunk. Each GOP costs the frames decoded to reach its last
    sampled index from its keyframe (`last - keyframe + 1`); walking the GOPs in order, a new chunk starts
    at the GOP whose cost midpoint passes the next multiple of `total / num_chunks`.

    Args:
        indices: sorted frame indices (repeats allowed).
        key_indices: sorted keyframe indices (frame 0 is treated as one).
        num_chunks: wanted number of chunks (>= 1).
    Returns:
        Non-empty chunks whose concatenation is `indices`.
    """
    if not indices:
        return []
    keys = np.asarray(sorted(set(key_indices) | {0}), dtype=np.int64)
    idx = np.asarray(indices, dtype=np.int64)
    gop_of = np.searchsorted(keys, idx, side="right") - 1  # [n]: GOP id of each index
    starts = np.flatnonzero(np.diff(gop_of)) + 1  # positions where a new GOP begins
    gops = [(members.tolist(), int(members[-1] - keys[gop_of[start]] + 1))  # (indices, decode cost)
            for members, start in zip(np.split(idx, starts), [0, *starts.tolist()], strict=True)]
    total = sum(cost for _, cost in gops)
    target = total / max(1, min(num_chunks, len(gops)))
    chunks: list[list[int]] = [[]]
    done = 0
    for members, cost in gops:
        if chunks[-1] and done + cost / 2 > target * len(chunks):
            chunks.append([])
        chunks[-1].extend(members)
        done += cost
    return chunks


def _decode_chunk(src: VideoSource, indices: list[int]) -> np.ndarray:
    """Decode one chunk with its own single-threaded reader: `[n, H, W, 3]` uint8."""
    return _open(src).get_batch(indices).asnumpy()


def decode_frames(
    src: VideoSource,
    indices: list[int],
    num_chunks: int = 1,
    deadline_s: float | None = None,
    key_indices: tuple[int, ...] | list[int] | None = None,
) -> torch.Tensor:
    """Decode the frames at `indices`, `num_chunks` keyframe-aligned chunks in parallel.

    Args:
        src: a local path or the file's bytes.
        indices: sorted frame indices (e.g. from `video_sampling.sample_indices`).
        num_chunks: parallel decoders (threads); 1 decodes on one thread.
        deadline_s: seconds the whole decode may take (None: no limit).
        key_indices: keyframes from `probe_video` (read from the video, within the deadline, when None).
    Returns:
        uint8 `[T, H, W, 3]` (channels last, as decord gives them), T = len(indices).
    Raises:
        DecodeError: (415) the bytes cannot be decoded.
        MediaError: (422, `decode_timeout`) the decode took longer than `deadline_s`; the video is
            treated as undecodable input, the stuck threads are abandoned.
    """
    if not indices:
        raise ValueError("no frame indices to decode")
    if any(b < a for a, b in zip(indices, indices[1:], strict=False)):
        raise ValueError("indices must be sorted")
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    if key_indices is None:
        (info,) = _run_all([lambda: _probe(src)], deadline, deadline_s)
        key_indices = info.key_indices
    chunks = plan_chunks(indices, key_indices, num_chunks)
    frames = _run_all([lambda chunk=chunk: _decode_chunk(src, chunk) for chunk in chunks], deadline, deadline_s)
    return torch.from_numpy(np.concatenate(frames) if len(frames) > 1 else frames[0])  # [T, H, W, 3]


def _run_all(tasks: list[Callable[[], T]], deadline: float | None, deadline_s: float | None) -> list[T]:
    """Run each task on its own daemon thread; results in task order, or raise at the first failure.

    A `MediaError` from a task is re-raised as is, any other exception becomes a `DecodeError`. Past
    `deadline` (a `time.monotonic()` value) we stop waiting: the threads still running are abandoned.
    """
    results: queue.Queue[tuple[int, object, BaseException | None]] = queue.Queue()

    def run(task_id: int, task: Callable[[], T]) -> None:
        try:
            results.put((task_id, task(), None))
        except BaseException as exc:  # noqa: B036 - handed to the waiting caller
            results.put((task_id, None, exc))

    for task_id, task in enumerate(tasks):
        threading.Thread(target=run, args=(task_id, task), name=f"video-decode-{task_id}", daemon=True).start()
    outputs: list = [None] * len(tasks)
    for _ in tasks:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            task_id, out, exc = results.get(timeout=timeout)
        except queue.Empty:
            raise MediaError(f"video decode exceeded its deadline of {deadline_s:g} s", code="decode_timeout",
                             status=422) from None
        if isinstance(exc, MediaError):
            raise exc
        if exc is not None:
            raise DecodeError(f"cannot decode video: {_short(exc)}") from exc
        outputs[task_id] = out
    return outputs


def _short(exc: BaseException) -> str:
    """First line of an exception (decord's messages carry a long C++ stack)."""
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
