"""`python -m bench.video`: decode 768 sampled frames of a long H.264 video, every decoding strategy in one run.

Variants (all from the file's bytes in memory, readers opened inside the timed region):
  sequential      one `VideoReader(num_threads=1).get_batch` (the baseline)
  ffmpeg_threads  one `VideoReader(num_threads=0)`: FFmpeg's own frame/slice threads
  naive_N         N equal runs of indices on N threads, one single-threaded reader each (no keyframe alignment)
  ours_N          `video_decode.decode_frames`: N balanced GOP-aligned chunks, one reader each, on threads
  queue_N         N CPU decoders taking smaller GOP-aligned chunks from one queue (`decode_frames_hybrid`, no GPU)
  dali_xK         K DALI NVDEC decoders alone (needs DALI + CUDA)
  hybrid_NcKg     `video_dali.decode_frames_hybrid`: N CPU decoders and K NVDEC decoders on one chunk queue
Frames of every CPU variant are compared with the sequential read (bit-identical expected); NVDEC frames
differ by colour conversion, so those rows report the mean/max absolute difference instead. The DALI rows end
with the frames on the GPU (CPU chunks are copied there as they finish), the CPU rows in host memory.
`work_frames` estimates the frames each variant must decode (from the keyframe before each run of indices).
The default video (1 hour 720p30, CRF 35, made with `bench.media_make`) takes minutes to decode
sequentially: `--duration 4 --width 64 --height 48 --frames 16` is a seconds-long smoke run.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import environment, markdown_table, write_results
from bench.media_make import DEFAULT_MEDIA_DIR, VideoSpec, make_video
from preprocess.errors import MediaError
from preprocess.video_decode import decode_frames, plan_chunks, probe_video
from preprocess.video_sampling import VideoSampling, sample_indices


def num_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parse_counts(text: str, cores: int) -> list[int]:
    """'4,8,cpu,2cpu' -> [4, 8, cores, 2 * cores], deduplicated, order kept."""
    counts: list[int] = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        n = cores * int(item[:-3] or 1) if item.endswith("cpu") else int(item)
        if n < 1:
            raise ValueError(f"counts must be >= 1, got {item!r}")
        if n not in counts:
            counts.append(n)
    return counts


def parse_hybrid(text: str, cores: int) -> list[tuple[int, int]]:
    """'16+4,cpu+7' -> [(16, 4), (cores, 7)]: CPU decoders + NVDEC decoders."""
    pairs = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        cpu, _, gpu = item.partition("+")
        pairs.append((cores if cpu == "cpu" else int(cpu), int(gpu or 0)))
    return pairs


def decode_work(indices: list[int], key_indices: tuple[int, ...], runs: list[list[int]]) -> int:
    """Frames the decoders must decode for `runs` of indices: per run, from the keyframe before its first index
    to its end, except that a jump past a keyframe restarts there (FFmpeg seeks instead of decoding through)."""
    keys = np.asarray(sorted(set(key_indices) | {0}))
    total = 0
    for run in runs:
        prev = None
        for i in run:
            key = int(keys[np.searchsorted(keys, i, side="right") - 1])
            if prev is None or key > prev:  # seek to the keyframe
                total += i - key + 1
            else:  # decode through from the previous index
                total += i - prev
            prev = i
    return total


def _run_threads(tasks: list[Callable[[], np.ndarray]]) -> list[np.ndarray]:
    outputs: list[Any] = [None] * len(tasks)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            outputs[i] = tasks[i]()
        except BaseException as exc:  # noqa: B036 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(tasks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return outputs


def sequential(data: bytes, indices: list[int], num_threads: int) -> torch.Tensor:
    import decord

    return torch.from_numpy(decord.VideoReader(io.BytesIO(data), num_threads=num_threads).get_batch(indices).asnumpy())


def naive_chunks(indices: list[int], num_chunks: int) -> list[list[int]]:
    return [part.tolist() for part in np.array_split(np.asarray(indices), num_chunks) if len(part)]


def naive(data: bytes, indices: list[int], num_chunks: int) -> torch.Tensor:
    runs = naive_chunks(indices, num_chunks)
    return torch.from_numpy(np.concatenate(_run_threads([lambda r=r: sequential(data, r, 1).numpy() for r in runs])))


def _s(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds * 1e3:.0f} ms"


def _dali_note(device: torch.device) -> str:
    """'' when the DALI variants can run here, else why not."""
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return "skipped: NVIDIA DALI is not installed (pip install 'mmenc[dali]')"
    if device.type != "cuda":
        return "skipped: no CUDA device (DALI's CPU decoder does not take H.264)"
    return ""


def _dali_variants(data: bytes, indices: list[int], keys: tuple[int, ...], work: int, device: torch.device,
                   dali_k: list[int], hybrids: list[tuple[int, int]], chunks_per_worker: int) -> list:
    """The dali_xK and hybrid_NcKg variants, their decoders built and warmed up first (not timed)."""
    from preprocess.video_dali import decode_frames_hybrid, get_pool

    device_id = device.index or 0
    max_gpu = max([*dali_k, *(g for _, g in hybrids)])
    start = time.perf_counter()
    get_pool(device_id).reserve(max_gpu)
    decode_frames_hybrid(data, indices[:2], keys, 0, 1, device_id)  # warm-up: CUDA context, NVDEC session
    print(f"DALI: {max_gpu} decoders built and warmed up in {time.perf_counter() - start:.1f} s", flush=True)
    variants = [(f"dali_x{k}", lambda k=k: decode_frames_hybrid(data, indices, keys, 0, k, device_id,
                                                                chunks_per_worker), work, False) for k in dali_k]
    variants += [(f"hybrid_{c}c{g}g", lambda c=c, g=g: decode_frames_hybrid(data, indices, keys, c, g, device_id,
                                                                           chunks_per_worker), work, False)
                 for c, g in hybrids]
    return variants


def summary_line(label: str, rows: list[dict[str, Any]], seq_s: float) -> str:
    """'SUMMARY <label>: ours 8.1 s (N=16) vs sequential 132.7 s (16.4x), ffmpeg threads ..., naive ..., hybrid ...'"""
    timed = {r["variant"]: r for r in rows if "seconds" in r}
    errors = [r["variant"] for r in rows if "error" in r]
    ours = [r for name, r in timed.items() if name.startswith(("ours_", "queue_"))]
    best = min(ours or timed.values(), key=lambda r: r["seconds"])
    kind, _, n = best["variant"].partition("_")
    how = f"N={n}" if kind == "ours" else f"{kind} N={n}" if n else kind
    line = (f"SUMMARY {label}: ours {_s(best['seconds'])} ({how}) vs sequential {_s(seq_s)} "
            f"({seq_s / best['seconds']:.1f}x)")
    if "ffmpeg_threads" in timed:
        line += f", ffmpeg threads {_s(timed['ffmpeg_threads']['seconds'])}"
    naive_rows = [r for name, r in timed.items() if name.startswith("naive_")]
    if naive_rows:
        line += f", naive {naive_rows[0]['variant'][6:]} chunks {_s(naive_rows[0]['seconds'])}"
    gpu_rows = [r for name, r in timed.items() if name.startswith(("hybrid_", "dali_"))]
    if gpu_rows:
        best_gpu = min(gpu_rows, key=lambda r: r["seconds"])
        line += f", {best_gpu['variant']} {_s(best_gpu['seconds'])}"
    if errors:
        line += f"; failed: {', '.join(errors)}"
    return line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.video", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--video", help="an existing video file (default: make one from the flags below)")
    p.add_argument("--media-dir", default=str(DEFAULT_MEDIA_DIR), help="where made videos are cached")
    p.add_argument("--duration", type=float, default=VideoSpec.duration_s, help="seconds of the made video")
    p.add_argument("--width", type=int, default=VideoSpec.width)
    p.add_argument("--height", type=int, default=VideoSpec.height)
    p.add_argument("--fps", type=int, default=VideoSpec.fps)
    p.add_argument("--clip-seconds", type=float, default=VideoSpec.clip_s)
    p.add_argument("--gop", type=int, default=VideoSpec.gop)
    p.add_argument("--crf", type=int, default=VideoSpec.crf)
    p.add_argument("--frames", type=int, default=768, help="frames to sample (qwen-vl-utils nframes)")
    p.add_argument("--chunks", default="4,8,16,cpu,2cpu", help="N for ours_N (cpu = this machine's cores)")
    p.add_argument("--naive-chunks", default="cpu", help="N for naive_N")
    p.add_argument("--dali-decoders", default="4", help="K for dali_xK (empty: none)")
    p.add_argument("--queue", default="cpu", help="N for queue_N (empty: none)")
    p.add_argument("--hybrid", default="cpu+4,cpu+7,12+4", help="N+K for hybrid_NcKg (cpu = cores; empty: none)")
    p.add_argument("--chunks-per-worker", type=int, default=2, help="queue and hybrid: chunks per worker")
    p.add_argument("--skip", default="", help="comma list of variant kinds to skip: ffmpeg_threads,naive,ours,queue,"
                   "dali,hybrid (sequential always runs: it is the baseline and the reference frames)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per variant (median reported)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="DALI's GPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--name", default="video")
    a = p.parse_args(argv)
    if importlib.util.find_spec("decord") is None:
        print("bench.video needs decord (pip install decord; for the H200: ../shared/tools/gpu-wheels)", flush=True)
        return 2
    torch.manual_seed(a.seed)
    cores = num_cores()
    skip = set(filter(None, a.skip.split(",")))
    device = torch.device(a.device)

    if a.video:
        path = Path(a.video)
    else:
        spec = VideoSpec(a.duration, a.width, a.height, a.fps, a.clip_seconds, a.crf, a.gop)
        start = time.perf_counter()
        path = make_video(spec, a.media_dir)
        print(f"video {path} ({path.stat().st_size / 1e6:.1f} MB; ready in {time.perf_counter() - start:.1f} s)",
              flush=True)
    data = path.read_bytes()
    start = time.perf_counter()
    info = probe_video(data)
    probe_s = time.perf_counter() - start
    indices = sample_indices(info.num_frames, info.fps, VideoSampling(nframes=a.frames))
    keys = info.key_indices
    work = decode_work(indices, keys, [indices])
    print(f"{info.num_frames} frames {info.width}x{info.height} @ {info.fps:g} fps ({info.duration_s:.0f} s), "
          f"{len(keys)} keyframes; {len(indices)} sampled, {work} frames to decode; probe {probe_s:.2f} s", flush=True)

    variants: list[tuple[str, Callable[[], torch.Tensor], int, bool]] = []  # name, run, work, exact
    if "ffmpeg_threads" not in skip:
        variants.append(("ffmpeg_threads", lambda: sequential(data, indices, 0), work, True))
    if "naive" not in skip:
        for n in parse_counts(a.naive_chunks, cores):
            variants.append((f"naive_{n}", lambda n=n: naive(data, indices, n),
                             decode_work(indices, keys, naive_chunks(indices, n)), True))
    if "ours" not in skip:
        for n in sorted(parse_counts(a.chunks, cores)):
            variants.append((f"ours_{n}", lambda n=n: decode_frames(data, indices, n, key_indices=keys),
                             decode_work(indices, keys, plan_chunks(indices, keys, n)), True))
    if "queue" not in skip:
        from preprocess.video_dali import decode_frames_hybrid

        for n in parse_counts(a.queue, cores):
            variants.append((f"queue_{n}", lambda n=n: decode_frames_hybrid(data, indices, keys, n, 0,
                                                                            chunks_per_worker=a.chunks_per_worker),
                             decode_work(indices, keys, plan_chunks(indices, keys, n * a.chunks_per_worker)), True))
    dali_k = parse_counts(a.dali_decoders, cores) if "dali" not in skip else []
    hybrids = parse_hybrid(a.hybrid, cores) if "hybrid" not in skip else []
    dali_note = _dali_note(device) if dali_k or hybrids else "not asked for"
    if not dali_note:
        try:
            variants += _dali_variants(data, indices, keys, work, device, dali_k, hybrids, a.chunks_per_worker)
        except (RuntimeError, MediaError) as exc:  # e.g. no NVDEC for this codec: the CPU variants still run
            dali_note = f"failed: {exc}"
    if dali_note:
        print(f"DALI variants {dali_note}", flush=True)

    # warm-up: libraries loaded, the file's bytes touched, one reader opened
    sequential(data, indices[:2], 1)
    decode_frames(data, indices[:2], 2, key_indices=keys)

    def timed(fn: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
        times, out = [], None
        for _ in range(max(1, a.repeats)):
            out = None  # free the previous frames first
            start = time.perf_counter()
            out = fn()
            if out.is_cuda:
                torch.cuda.synchronize(out.device)
            times.append(time.perf_counter() - start)
        return statistics.median(times), out

    rows: list[dict[str, Any]] = []
    payload: dict[str, Any] = {
        "bench": "video", "video": str(path), "video_mb": len(data) / 1e6, "num_frames": info.num_frames,
        "fps": info.fps, "width": info.width, "height": info.height, "duration_s": info.duration_s,
        "num_keyframes": len(keys), "num_sampled": len(indices), "decode_work_frames": work, "probe_s": probe_s,
        "cores": cores, "dali": {"note": dali_note}, "env": environment(device),
        "argv": argv if argv is not None else sys.argv[1:], "rows": rows, "identical": None}

    seq_s, reference = timed(lambda: sequential(data, indices, 1))
    rows.append({"variant": "sequential", "seconds": seq_s, "speedup": 1.0, "work_frames": work,
                 "decode_fps": work / seq_s, "identical": True})
    print(rows[-1], flush=True)
    identical = True
    for name, fn, variant_work, exact in variants:
        try:
            seconds, frames = timed(fn)
        except (RuntimeError, MediaError) as exc:  # one broken variant does not lose the others
            rows.append({"variant": name, "error": str(exc)[:300], "identical": False})
            identical &= not exact
            print(rows[-1], flush=True)
            continue
        row: dict[str, Any] = {"variant": name, "seconds": seconds, "speedup": seq_s / seconds,
                               "work_frames": variant_work, "decode_fps": variant_work / seconds}
        frames = frames.cpu()
        same = frames.shape == reference.shape and torch.equal(frames, reference)
        row["identical"] = same
        if exact:
            identical &= same
        elif frames.shape == reference.shape:
            diff = (frames.int() - reference.int()).abs()
            row["mean_abs_diff"], row["max_abs_diff"] = diff.float().mean().item(), int(diff.max())
        del frames
        rows.append(row)
        print(row, flush=True)
        payload["identical"] = identical
        write_results(a.name, a.out_dir, payload)  # after every variant: a killed run keeps what it measured
    payload["identical"] = identical
    out_path = write_results(a.name, a.out_dir, payload)
    print(markdown_table(rows, ["variant", "seconds", "speedup", "work_frames", "decode_fps", "identical"]))

    label = f"video decode {len(indices)} frames of {info.duration_s:.0f} s {info.height}p"
    print(f"{summary_line(label, rows, seq_s)}; identical: {str(identical).lower()}; results in {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
