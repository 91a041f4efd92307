"""`python -m bench.audio`: Whisper log-mel of a batch of 30 s clips, ours on the device vs transformers, and
`decode_audio` of WAV / FLAC / MP3, in one run.

Log-mel: `preprocess.mel.log_mel` (one batched `torch.stft` on the device, from waveforms in host memory, so
the copy to the device is counted; a second row starts from waveforms already there) against transformers'
`WhisperFeatureExtractor` on the CPU (its default path; on the device too when CUDA is there). Equality is
checked on a few clips (max abs difference <= 1e-4). Figures: clips/s and x real time (audio seconds per
second). Decode: a 60 s 44.1 kHz stereo speech-like clip made by `bench.media_make` (FLAC and MP3 need PyAV
to be made; pass `--media-dir` with files made elsewhere where PyAV is missing), decoded to 16 kHz mono.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np
import torch

from bench.common import environment, markdown_table, time_median, write_results
from bench.media_make import AUDIO_FORMATS, DEFAULT_MEDIA_DIR, make_audio, speech_like
from preprocess.audio import decode_audio
from preprocess.mel import CHUNK_SECONDS, NUM_WINDOW_SAMPLES, SAMPLE_RATE, log_mel

TOLERANCE = 1e-4
TARGET_SPEEDUP = 50.0


def speech_batch(num_clips: int, seed: int = 0, num_distinct: int = 4) -> np.ndarray:
    """Seeded float32 `[B, 480000]` 30 s 16 kHz clips: `num_distinct` speech-like signals, each clip a random
    rotation and gain of one of them plus its own noise (so no two clips are equal)."""
    rng = np.random.default_rng(seed)
    bases = [speech_like(CHUNK_SECONDS, SAMPLE_RATE, seed + i)[0] for i in range(min(num_distinct, num_clips))]
    clips = np.empty((num_clips, NUM_WINDOW_SAMPLES), dtype=np.float32)
    for i in range(num_clips):
        shifted = np.roll(bases[i % len(bases)], int(rng.integers(NUM_WINDOW_SAMPLES)))
        clips[i] = shifted * rng.uniform(0.5, 1.5) + rng.normal(0, 0.005, NUM_WINDOW_SAMPLES)
    return np.clip(clips, -1, 1)


def _mel_rows(a: argparse.Namespace, device: torch.device, clips: np.ndarray) -> tuple[list[dict[str, Any]], float]:
    """Timed log-mel rows and the max abs difference of ours (on `device`) vs transformers on a few clips."""
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=a.num_mels)
    host = torch.from_numpy(clips)  # [B, 480000]
    rows: list[dict[str, Any]] = []

    def add(name: str, fn, dev: torch.device, iters: int, num_clips: int) -> None:
        seconds = time_median(fn, dev, warmup=1, iters=iters, max_seconds=a.max_seconds)
        rows.append({"pipeline": name, "batch": num_clips, "ms_per_batch": seconds * 1e3,
                     "clips_s": num_clips / seconds, "x_realtime": num_clips * CHUNK_SECONDS / seconds})
        print(rows[-1], flush=True)

    baseline = clips[:a.baseline_clips] if a.baseline_clips else clips
    baseline_list = list(baseline)
    add("transformers WhisperFeatureExtractor cpu",
        lambda: fe(baseline_list, sampling_rate=SAMPLE_RATE, return_tensors="np"), torch.device("cpu"),
        max(1, a.repeats // 2), len(baseline))
    clip_list = list(clips)
    if device.type == "cuda":
        add(f"transformers WhisperFeatureExtractor {device.type}",
            lambda: fe(clip_list, sampling_rate=SAMPLE_RATE, return_tensors="pt", device=str(device)), device,
            a.repeats, len(clips))
    if device.type != "cpu":
        add("mmenc log_mel cpu", lambda: log_mel(host, a.num_mels, "cpu"), torch.device("cpu"),
            max(1, a.repeats // 2), len(clips))
    if device.type != "cpu":
        on_device = host.to(device)
        add(f"mmenc log_mel {device.type}, waveforms on {device.type}",
            lambda: log_mel(on_device, a.num_mels, device), device, a.repeats, len(clips))
    add(f"mmenc log_mel {device.type}, waveforms from host", lambda: log_mel(host, a.num_mels, device), device,
        a.repeats, len(clips))

    check = clips[:a.check_clips]
    ref = fe(list(check), sampling_rate=SAMPLE_RATE, return_tensors="np").input_features  # [n, mels, 3000]
    ours = log_mel(torch.from_numpy(check), a.num_mels, device).cpu().numpy()
    return rows, float(np.abs(ours - ref).max())


def _decode_rows(a: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for fmt in filter(None, a.formats.split(",")):
        row: dict[str, Any] = {"format": fmt, "audio_s": a.audio_seconds}
        try:
            data = make_audio(fmt, a.audio_seconds, media_dir=a.media_dir).read_bytes()
            decoded = decode_audio(data)  # warm-up, and the output checked below
            seconds = time_median(lambda d=data: decode_audio(d), torch.device("cpu"), warmup=0,
                                  iters=a.repeats, max_seconds=a.max_seconds)
        except (RuntimeError, ImportError) as exc:  # no PyAV to make FLAC/MP3, or no decord to decode them
            row["note"] = f"skipped: {exc}"
            rows.append(row)
            print(f"decode {fmt}: {row['note']}", flush=True)
            continue
        row.update(file_mb=len(data) / 1e6, ms=seconds * 1e3, x_realtime=a.audio_seconds / seconds,
                   out_seconds=decoded.duration_s, source_rate=decoded.source_sample_rate,
                   num_channels=decoded.num_channels, note="")
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.audio", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=64, help="30 s clips per log-mel batch")
    p.add_argument("--num-mels", type=int, default=80, choices=[80, 128])
    p.add_argument("--baseline-clips", type=int, default=0, help="clips for the CPU baseline (0: the whole batch)")
    p.add_argument("--check-clips", type=int, default=4, help="clips compared with transformers")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--max-seconds", type=float, default=20.0, help="timing budget per row")
    p.add_argument("--formats", default=",".join(AUDIO_FORMATS), help="decode rows (empty: none)")
    p.add_argument("--audio-seconds", type=float, default=60.0, help="length of the decoded clip")
    p.add_argument("--media-dir", default=str(DEFAULT_MEDIA_DIR), help="where made audio files are cached")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--name", default="audio")
    a = p.parse_args(argv)
    if a.batch < 1 or a.check_clips < 1:
        p.error("--batch and --check-clips must be >= 1")
    torch.manual_seed(a.seed)
    device = torch.device(a.device)

    start = time.perf_counter()
    clips = speech_batch(a.batch, a.seed)
    print(f"{a.batch} clips of {CHUNK_SECONDS} s made in {time.perf_counter() - start:.1f} s", flush=True)
    mel_rows, max_diff = _mel_rows(a, device, clips)
    base = mel_rows[0]["clips_s"]
    for row in mel_rows:
        row["speedup"] = row["clips_s"] / base
    decode_rows = _decode_rows(a)

    ours = mel_rows[-1]  # from host waveforms: what the server pays
    is_equal = max_diff <= TOLERANCE
    payload = {"bench": "audio", "batch": a.batch, "num_mels": a.num_mels, "clip_s": CHUNK_SECONDS,
               "max_abs_diff": max_diff, "tolerance": TOLERANCE, "within_tolerance": is_equal,
               "speedup": ours["speedup"], "target_speedup": TARGET_SPEEDUP,
               "target_met": device.type == "cuda" and ours["speedup"] >= TARGET_SPEEDUP,
               "env": environment(device), "argv": argv if argv is not None else sys.argv[1:],
               "mel_rows": mel_rows, "decode_rows": decode_rows}
    path = write_results(a.name, a.out_dir, payload)
    print(markdown_table(mel_rows, ["pipeline", "batch", "ms_per_batch", "clips_s", "x_realtime", "speedup"]))
    print(markdown_table(decode_rows, ["format", "audio_s", "file_mb", "ms", "x_realtime", "note"]))
    decoded = ", ".join(f"{r['format']} {r['ms']:.0f} ms" for r in decode_rows if "ms" in r)
    print(f"SUMMARY audio log-mel {a.batch} x {CHUNK_SECONDS} s on {device.type}: {ours['clips_s']:.0f} clips/s "
          f"({ours['x_realtime']:.0f}x real time), {ours['speedup']:.1f}x transformers cpu "
          f"({base:.1f} clips/s); max diff {max_diff:.1e} (<= {TOLERANCE:g}: {str(is_equal).lower()}); "
          f"decode {a.audio_seconds:g} s: {decoded or 'none'}; results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
