"""Video decoding with NVIDIA DALI: NVDEC on the GPU, alone or as extra workers beside CPU decoders.

DALI (2.x) decodes a video held in memory with `fn.decoders.video` (the older name,
`fn.experimental.decoders.video`, is a deprecated alias). Its `frames` argument takes arbitrary sorted or
unsorted indices (a tensor argument, so one pipeline serves any index list, fed per run); with
`build_index=True` (the default) it seeks to the keyframe before a far-away index instead of decoding
everything in between. `pad_mode="none"` makes an index past the end an error instead of a black frame.

- `device_id=int`: the `mixed` decoder (demux on the CPU, NVDEC, output uint8 RGB on the GPU). H.264,
  HEVC, AV1, MPEG-4, VP8, VP9, MJPEG.
- `device_id=None`: DALI's CPU decoder (libavcodec): VP8, VP9 and MJPEG only, not H.264/HEVC. Its
  YUV->RGB conversion is not decord's (swscale), so frames differ by a few levels (see the test).

One NVDEC decoder is slower than the 16 CPU decoders of the H200 (92 s vs ~8 s for 768 frames of a 1-hour
720p H.264), but the GPU has several NVDEC engines: `decode_frames_hybrid` runs CPU decoders (decord,
`num_threads=1`, as `video_decode.decode_frames`) and DALI decoders side by side, all pulling GOP-aligned
chunks from one queue, so faster workers take more chunks.

`nvidia.dali` is imported only when a DALI decoder is built: importing this module needs neither DALI nor CUDA.
"""

from __future__ import annotations

import io
import queue
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from preprocess.errors import DecodeError, MediaError
from preprocess.video_decode import plan_chunks


def check_dali(device_id: int | None) -> None:
    """Raise RuntimeError (saying what is missing) unless DALI video decoding can run on `device_id`."""
    _require_dali(device_id)


def _require_dali(device_id: int | None):  # -> the nvidia.dali module
    """Import DALI and check the device; RuntimeError saying what is missing."""
    try:
        import nvidia.dali as dali
    except ImportError as exc:
        raise RuntimeError("DALI video decoding needs NVIDIA DALI: pip install 'mmenc[dali]' "
                           "(nvidia-dali-cuda130)") from exc
    if device_id is not None:
        if not torch.cuda.is_available():
            raise RuntimeError("DALI GPU video decoding (mixed, NVDEC) needs CUDA, and none is available here; "
                               "device_id=None uses DALI's CPU decoder (VP8/VP9/MJPEG only)")
        if not 0 <= device_id < torch.cuda.device_count():
            raise RuntimeError(f"no CUDA device {device_id} (this machine has {torch.cuda.device_count()})")
    return dali


class DaliVideoDecoder:
    """One DALI pipeline (one decoder instance) on one device; feed it a video and the frames to extract.

    Not thread-safe: use one per thread (`DaliVideoDecoderPool` hands them out).
    """

    def __init__(self, device_id: int | None = 0, num_threads: int = 2) -> None:
        self.device_id = device_id
        self.num_threads = num_threads
        self._pipe = self._build()

    def _build(self):  # -> nvidia.dali.Pipeline
        dali = _require_dali(self.device_id)
        fn, types = dali.fn, dali.types
        decoder_device = "cpu" if self.device_id is None else "mixed"

        @dali.pipeline_def(batch_size=1, num_threads=self.num_threads, device_id=self.device_id,
                           prefetch_queue_depth=1)
        def pipeline():
            encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
            frames = fn.external_source(name="frames", dtype=types.INT32, ndim=1)
            # NOTE: affine=False: pinned decoder threads would pile onto the cores the CPU decoders need.
            return fn.decoders.video(encoded, frames=frames, device=decoder_device, pad_mode="none",
                                     **({"affine": False} if decoder_device == "mixed" else {}))

        pipe = pipeline()
        pipe.build()
        return pipe

    def decode(self, data: np.ndarray, indices: list[int]) -> torch.Tensor:
        """Frames `indices` of the encoded video `data` (uint8 `[N]`): uint8 `[T, H, W, 3]`, on the GPU for
        a mixed decoder, else on the CPU.

        Raises:
            DecodeError: DALI cannot decode it (corrupt data, an unsupported codec, an index past the end).
        """
        try:
            self._pipe.feed_input("encoded", [data])
            self._pipe.feed_input("frames", [np.asarray(indices, dtype=np.int32)])
            (out,) = self._pipe.run()
            # NOTE: DALI reuses its output buffers on the next run, so the frames are copied out.
            if self.device_id is None:
                return torch.from_numpy(np.array(out[0]))  # [T, H, W, 3]
            return torch.from_dlpack(out[0]).clone()  # [T, H, W, 3]
        except RuntimeError as exc:
            self._pipe = self._build()  # a failed pipeline is no longer usable
            reason = _reason(exc)
            if self.device_id is None and "Failed to create video decoder" in reason:
                reason += " (DALI's CPU decoder takes VP8/VP9/MJPEG only)"
            raise DecodeError(f"DALI cannot decode video: {reason}") from exc


def _reason(exc: BaseException) -> str:
    """The line of a DALI error that says what went wrong (it follows "encountered:"; C++ context elided)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if "encountered:" in lines and lines.index("encountered:") + 1 < len(lines):
        return lines[lines.index("encountered:") + 1][:300]
    useful = [line for line in lines if "Critical error" not in line and "no longer valid" not in line]
    return (useful or lines or [type(exc).__name__])[-1][:300]


class DaliVideoDecoderPool:
    """Idle `DaliVideoDecoder`s of one device; a new one is built when all are busy. Thread-safe."""

    def __init__(self, device_id: int | None) -> None:
        self.device_id = device_id
        self._idle: queue.SimpleQueue[DaliVideoDecoder] = queue.SimpleQueue()

    def reserve(self, num_decoders: int) -> None:
        """Build decoders until `num_decoders` are idle (so a timed run does not pay for building them)."""
        built = []
        while True:
            try:
                built.append(self._idle.get_nowait())
            except queue.Empty:
                break
        built += [DaliVideoDecoder(self.device_id) for _ in range(num_decoders - len(built))]
        for decoder in built:
            self._idle.put(decoder)

    def decode(self, data: np.ndarray, indices: list[int]) -> torch.Tensor:
        try:
            decoder = self._idle.get_nowait()
        except queue.Empty:
            decoder = DaliVideoDecoder(self.device_id)
        try:
            return decoder.decode(data, indices)
        finally:
            self._idle.put(decoder)


_pools: dict[int | None, DaliVideoDecoderPool] = {}
_pools_lock = threading.Lock()


def get_pool(device_id: int | None) -> DaliVideoDecoderPool:
    """The process-wide decoder pool of a CUDA device (None: DALI's CPU decoder)."""
    _require_dali(device_id)
    with _pools_lock:
        if device_id not in _pools:
            _pools[device_id] = DaliVideoDecoderPool(device_id)
        return _pools[device_id]


def _as_array(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return data
    if len(data) == 0:
        raise DecodeError("video is empty (0 bytes)", code="empty_video")
    return np.frombuffer(data, dtype=np.uint8)


def decode_frames_dali(data: bytes, indices: list[int], device_id: int | None = 0) -> torch.Tensor:
    """Decode the frames at `indices` of an in-memory video with one DALI decoder.

    Args:
        data: the video file's bytes.
        indices: frame indices (any order, repeats allowed).
        device_id: CUDA device for NVDEC (`mixed`); None: DALI's CPU decoder (VP8/VP9/MJPEG only).
    Returns:
        uint8 `[T, H, W, 3]` RGB, T = len(indices), on `cuda:device_id` (CPU when `device_id` is None).
    Raises:
        RuntimeError: DALI is not installed, or CUDA / that device is missing.
        DecodeError: (415) DALI cannot decode the video or an index is past its end.
    """
    if not indices:
        raise ValueError("no frame indices to decode")
    return get_pool(device_id).decode(_as_array(data), list(indices))


def decode_frames_hybrid(
    data: bytes,
    indices: list[int],
    key_indices: tuple[int, ...] | list[int],
    num_cpu: int,
    num_gpu: int,
    device_id: int | None = 0,
    chunks_per_worker: int = 2,
    deadline_s: float | None = None,
) -> torch.Tensor:
    """Decode `indices` with `num_cpu` decord decoders and `num_gpu` DALI decoders working side by side.

    The indices are cut into `chunks_per_worker * (num_cpu + num_gpu)` keyframe-aligned chunks
    (`plan_chunks`); every worker thread takes the next chunk from one queue until none is left. A CPU
    worker keeps one `VideoReader(num_threads=1)` for all its chunks (they come in increasing order).

    Args:
        data: the video file's bytes.
        indices: sorted frame indices.
        key_indices: keyframes (`probe_video(...).key_indices`).
        num_cpu, num_gpu: CPU (decord) and DALI workers (>= 0, not both 0).
        device_id: CUDA device of the DALI decoders and of the output; None: DALI's CPU decoder, CPU output.
        chunks_per_worker: chunks per worker (more balance vs more per-chunk overhead).
        deadline_s: seconds the decode may take (None: no limit); the workers still running are abandoned.
    Returns:
        uint8 `[T, H, W, 3]` on `cuda:device_id` when DALI workers run on a GPU, else on the CPU. CPU chunks
        are bit-identical to a sequential decord read; NVDEC chunks differ by a few levels (colour conversion).
    Raises:
        RuntimeError: DALI or CUDA missing while `num_gpu > 0`.
        DecodeError: (415) a chunk cannot be decoded; MediaError: (422) past the deadline.
    """
    if num_cpu < 0 or num_gpu < 0 or num_cpu + num_gpu == 0:
        raise ValueError(f"need at least one worker, got num_cpu={num_cpu}, num_gpu={num_gpu}")
    if not indices:
        raise ValueError("no frame indices to decode")
    if any(b < a for a, b in zip(indices, indices[1:], strict=False)):
        raise ValueError("indices must be sorted")
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    array = _as_array(data)
    pool = get_pool(device_id) if num_gpu else None
    out_device = torch.device("cpu") if pool is None or device_id is None else torch.device("cuda", device_id)
    chunks = plan_chunks(indices, key_indices, max(1, chunks_per_worker) * (num_cpu + num_gpu))
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for chunk_id in range(len(chunks)):
        todo.put(chunk_id)
    results: queue.SimpleQueue[tuple[int, torch.Tensor | None, BaseException | None]] = queue.SimpleQueue()

    def work(decode: Callable[[list[int]], torch.Tensor]) -> None:
        while True:
            try:
                chunk_id = todo.get_nowait()
            except queue.Empty:
                return
            try:
                results.put((chunk_id, decode(chunks[chunk_id]), None))
            except BaseException as exc:  # noqa: B036 - handed to the waiting caller
                results.put((chunk_id, None, exc))
                return

    def cpu_worker() -> None:
        readers: list = []

        def decode(chunk: list[int]) -> torch.Tensor:
            import decord

            if not readers:
                readers.append(decord.VideoReader(io.BytesIO(data), num_threads=1))
            return torch.from_numpy(readers[0].get_batch(chunk).asnumpy())  # [n, H, W, 3]

        work(decode)

    def gpu_worker() -> None:
        work(lambda chunk: pool.decode(array, chunk))

    targets = [cpu_worker] * num_cpu + [gpu_worker] * num_gpu
    for i, target in enumerate(targets):
        threading.Thread(target=target, name=f"video-hybrid-{i}", daemon=True).start()
    frames: list[torch.Tensor | None] = [None] * len(chunks)
    for _ in chunks:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            chunk_id, out, exc = results.get(timeout=timeout)
        except queue.Empty:
            raise MediaError(f"video decode exceeded its deadline of {deadline_s:g} s", code="decode_timeout",
                             status=422) from None
        if isinstance(exc, MediaError):
            raise exc
        if exc is not None:
            raise DecodeError(f"cannot decode video: {str(exc).strip()[:200]}") from exc
        frames[chunk_id] = out.to(out_device, non_blocking=True)
    return torch.cat(frames) if len(frames) > 1 else frames[0]  # [T, H, W, 3]
