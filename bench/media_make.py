"""Synthetic test media for `bench.video` and `bench.audio`, cached on disk by their parameters.

Video: a testsrc-like clip (colour bars, a moving gradient and box, frame-number bars so every frame
differs) encoded once with PyAV (libx264 CRF 35 veryfast, or any codec PyAV has), then repeated by stream
copy until the wanted duration, as `ffmpeg -f concat -c copy` would: 60 x 60 s of 720p30 is ~27 MB and
decodes like the file the issue's figures were measured on. Without PyAV the `ffmpeg` binary is used.
Audio: one seeded speech-like signal (chirps + noise) written as WAV (exact PCM), FLAC and MP3 (PyAV).

The H200 machine has neither PyAV nor ffmpeg: make the files here and carry the folder, e.g.
`python -m bench.media_make --media-dir .media` then `python -m bench.video --media-dir .media` there.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tempfile
import wave
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

DEFAULT_MEDIA_DIR = Path(tempfile.gettempdir()) / "mmenc-bench-media"


@dataclass(frozen=True)
class VideoSpec:
    """A synthetic video: `duration_s` made of `clip_s` clips, each starting on a keyframe."""

    duration_s: float = 3600.0
    width: int = 1280
    height: int = 720
    fps: int = 30
    clip_s: float = 60.0
    crf: int = 35
    gop: int = 250  # x264's default keyint, as `ffmpeg -c:v libx264` uses
    codec: str = "libx264"
    container: str = "mp4"

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.clip_s <= 0 or self.fps <= 0:
            raise ValueError("duration_s, clip_s and fps must be > 0")
        if self.width % 2 or self.height % 2 or self.width < 16 or self.height < 16:
            raise ValueError(f"size must be even and >= 16, got {self.width}x{self.height}")

    @property
    def clip_frames(self) -> int:
        return max(1, round(min(self.clip_s, self.duration_s) * self.fps))

    @property
    def num_clips(self) -> int:
        return max(1, round(self.duration_s * self.fps / self.clip_frames))

    @property
    def file_name(self) -> str:
        return (f"video_{self.codec}_{self.width}x{self.height}_{self.fps}fps_{self.duration_s:g}s_"
                f"clip{self.clip_s:g}_crf{self.crf}_g{self.gop}.{self.container}")


def testsrc_frames(num_frames: int, width: int, height: int):  # -> Iterator[np.ndarray]
    """RGB uint8 `[H, W, 3]` frames like ffmpeg's testsrc: bars, a scrolling gradient, a moving box, counters."""
    bars = np.array([[191, 191, 191], [191, 191, 0], [0, 191, 191], [0, 191, 0], [191, 0, 191], [191, 0, 0],
                     [0, 0, 191]], dtype=np.uint8)
    xx = np.arange(width)
    background = np.empty((height, width, 3), dtype=np.uint8)
    background[:] = bars[xx * len(bars) // width][None]
    ramp = (np.arange(2 * width) * 255 // (2 * width - 1)).astype(np.uint8)
    band = slice(height * 2 // 3, height * 5 // 6)
    box = max(4, height // 8)
    bit_w = max(1, width // 32)
    for i in range(num_frames):
        frame = background.copy()
        frame[band] = ramp[(xx + 4 * i) % (2 * width)][None, :, None]  # scrolling gradient
        x0 = (7 * i) % max(1, width - box)
        y0 = (3 * i) % max(1, height // 2 - box)
        frame[y0:y0 + box, x0:x0 + box] = (255, 255, 255)
        for bit in range(16):  # the frame number in binary: no two frames are alike
            frame[height - bit_w:, bit * bit_w:(bit + 1) * bit_w] = 255 if (i >> bit) & 1 else 0
        yield frame


def encode_clip(num_frames: int, width: int, height: int, fps: int, codec: str = "libx264",
                container: str = "mp4", crf: int = 35, gop: int = 250) -> bytes:
    """Encode `num_frames` testsrc-like frames with PyAV; returns the file's bytes."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.gop_size = gop
        if codec == "libx264":
            stream.options = {"crf": str(crf), "preset": "veryfast"}
        elif codec.startswith("libvpx"):
            stream.options = {"crf": str(crf), "b": "0", "deadline": "realtime", "cpu-used": "8"}
        for rgb in testsrc_frames(num_frames, width, height):
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def concat_copy(clip: bytes, times: int, container: str) -> bytes:
    """`clip` repeated `times` times by stream copy (no re-encode): timestamps shifted per repeat."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        offset = 0
        out_stream = None
        for _ in range(times):
            with av.open(io.BytesIO(clip)) as src:
                in_stream = src.streams.video[0]
                if out_stream is None:
                    out_stream = out.add_stream_from_template(in_stream)
                last = offset
                for packet in src.demux(in_stream):
                    if packet.dts is None:  # the demuxer's flush packet
                        continue
                    end = max(packet.pts, packet.dts) + (packet.duration or 0)
                    last = max(last, offset + end)
                    packet.pts += offset
                    packet.dts += offset
                    packet.stream = out_stream
                    out.mux(packet)
                offset = last
    return buf.getvalue()


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def _make_with_ffmpeg(spec: VideoSpec, path: Path) -> None:
    """The same file with the ffmpeg binary (testsrc + concat demuxer), where PyAV is missing."""
    with tempfile.TemporaryDirectory() as tmp:
        clip = Path(tmp) / f"clip.{spec.container}"
        subprocess.run(["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i",
                        f"testsrc=size={spec.width}x{spec.height}:rate={spec.fps}",
                        "-frames:v", str(spec.clip_frames), "-c:v", spec.codec, "-crf", str(spec.crf),
                        "-preset", "veryfast", "-g", str(spec.gop), "-pix_fmt", "yuv420p", str(clip)], check=True)
        listing = Path(tmp) / "list.txt"
        listing.write_text(f"file '{clip}'\n" * spec.num_clips)
        out = Path(tmp) / f"out.{spec.container}"
        subprocess.run(["ffmpeg", "-v", "error", "-y", "-f", "concat", "-safe", "0", "-i", str(listing), "-c", "copy",
                        str(out)], check=True)
        _write_atomic(path, out.read_bytes())


def make_video(spec: VideoSpec, media_dir: str | Path = DEFAULT_MEDIA_DIR) -> Path:
    """Path of the video for `spec` under `media_dir`, made (PyAV, else ffmpeg) unless already there.

    Raises:
        RuntimeError: neither PyAV nor the ffmpeg binary is available to make a missing file.
    """
    path = Path(media_dir) / spec.file_name
    if path.exists():
        return path
    try:
        import av  # noqa: F401
    except ImportError:
        if shutil.which("ffmpeg") is None:
            raise RuntimeError(f"{path} does not exist and neither PyAV nor ffmpeg is here to make it; make it on "
                               f"another machine (python -m bench.media_make --media-dir DIR ...) and pass "
                               f"--media-dir DIR or --video PATH") from None
        _make_with_ffmpeg(spec, path)
        return path
    clip = encode_clip(spec.clip_frames, spec.width, spec.height, spec.fps, spec.codec, spec.container, spec.crf,
                       spec.gop)
    _write_atomic(path, clip if spec.num_clips == 1 else concat_copy(clip, spec.num_clips, spec.container))
    return path


# ------------------------------------------------------------------------------------------------- audio

AUDIO_FORMATS = ("wav", "flac", "mp3")


def speech_like(duration_s: float, sample_rate: int = 16000, seed: int = 0, num_channels: int = 1) -> np.ndarray:
    """Seeded speech-like float32 `[C, N]` in [-1, 1]: syllable-rate gated chirps with harmonics, plus noise."""
    rng = np.random.default_rng(seed)
    n = int(duration_s * sample_rate)
    t = np.arange(n) / sample_rate
    signal = np.zeros(n)
    for _ in range(4):
        f0, f1 = rng.uniform(90, 300), rng.uniform(90, 300)  # a pitch glide per voice
        period = rng.uniform(1.0, 4.0)
        phase = 2 * np.pi * (f0 * t + (f1 - f0) * period / (2 * np.pi) * (1 - np.cos(2 * np.pi * t / period)) / 2)
        voice = sum(np.sin(k * phase) / k for k in range(1, 6))  # harmonics
        gate = 0.5 + 0.5 * np.sin(2 * np.pi * rng.uniform(3, 6) * t + rng.uniform(0, 6.3))  # syllables
        signal += voice * gate ** 2
    signal = 0.2 * signal / np.abs(signal).max() + 0.01 * rng.standard_normal(n)
    channels = [signal] + [np.roll(signal, 17 * c) for c in range(1, num_channels)]
    return np.clip(np.stack(channels), -1, 1).astype(np.float32)


def wav_bytes(samples: np.ndarray, sample_rate: int) -> bytes:
    """16-bit PCM WAV of float `[C, N]`."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(samples.shape[0])
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes((np.clip(samples.T, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def encode_audio(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """FLAC or MP3 (PyAV) of float `[C, N]`; WAV without PyAV."""
    if fmt == "wav":
        return wav_bytes(samples, sample_rate)
    import av

    codec, sample_fmt = {"flac": ("flac", "s16"), "mp3": ("libmp3lame", "fltp")}[fmt]
    layout = {1: "mono", 2: "stereo"}[samples.shape[0]]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=sample_rate, layout=layout)
        stream.codec_context.time_base = Fraction(1, sample_rate)
        frame_size = 1152
        pcm = (samples * 32767).astype(np.int16) if sample_fmt == "s16" else samples
        for start in range(0, samples.shape[1], frame_size):
            part = pcm[:, start:start + frame_size]
            data = part.T.reshape(1, -1) if sample_fmt == "s16" else np.ascontiguousarray(part)  # packed vs planar
            frame = av.AudioFrame.from_ndarray(data, format=sample_fmt, layout=layout)
            frame.sample_rate, frame.pts = sample_rate, start
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def make_audio(fmt: str, duration_s: float = 60.0, sample_rate: int = 44100, num_channels: int = 2,
               media_dir: str | Path = DEFAULT_MEDIA_DIR, seed: int = 0) -> Path:
    """Path of a speech-like clip in `fmt` under `media_dir`, made unless already there.

    Raises:
        RuntimeError: FLAC/MP3 is missing and PyAV cannot make it here.
    """
    if fmt not in AUDIO_FORMATS:
        raise ValueError(f"audio format must be one of {AUDIO_FORMATS}, got {fmt!r}")
    path = Path(media_dir) / f"speech_{duration_s:g}s_{sample_rate}hz_{num_channels}ch_seed{seed}.{fmt}"
    if path.exists():
        return path
    try:
        data = encode_audio(speech_like(duration_s, sample_rate, seed, num_channels), sample_rate, fmt)
    except ImportError:
        raise RuntimeError(f"{path} does not exist and PyAV is not here to encode {fmt.upper()}; make it on another "
                           f"machine (python -m bench.media_make --media-dir DIR) and pass --media-dir DIR") from None
    _write_atomic(path, data)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.media_make", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--media-dir", default=str(DEFAULT_MEDIA_DIR))
    p.add_argument("--duration", type=float, default=VideoSpec.duration_s, help="video seconds")
    p.add_argument("--width", type=int, default=VideoSpec.width)
    p.add_argument("--height", type=int, default=VideoSpec.height)
    p.add_argument("--fps", type=int, default=VideoSpec.fps)
    p.add_argument("--clip-seconds", type=float, default=VideoSpec.clip_s)
    p.add_argument("--crf", type=int, default=VideoSpec.crf)
    p.add_argument("--gop", type=int, default=VideoSpec.gop)
    p.add_argument("--audio-seconds", type=float, default=60.0)
    p.add_argument("--no-audio", action="store_true")
    a = p.parse_args(argv)
    spec = VideoSpec(a.duration, a.width, a.height, a.fps, a.clip_seconds, a.crf, a.gop)
    paths = [make_video(spec, a.media_dir)]
    if not a.no_audio:
        paths += [make_audio(fmt, a.audio_seconds, media_dir=a.media_dir) for fmt in AUDIO_FORMATS]
    for path in paths:
        print(f"{path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
