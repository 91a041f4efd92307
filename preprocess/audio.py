"""Audio bytes -> mono float32 16 kHz waveform.

The container is recognised from its header (WAV, FLAC, MP3), which also gives the source sample rate and,
for WAV and FLAC, the duration before anything is decoded. WAV is read directly (numpy, exact); FLAC and MP3
go through FFmpeg (decord's `AudioReader`) at the source rate. Channels are averaged, then a Kaiser-windowed
sinc polyphase filter (torch) resamples to 16 kHz.
"""

from __future__ import annotations

import io
import math
import struct
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from preprocess.errors import DecodeError, MediaTooLarge

TARGET_SAMPLE_RATE = 16000
MIN_SAMPLE_RATE = 4000
MAX_SAMPLE_RATE = 384000
DEFAULT_MAX_DURATION_S = 3600.0
# NOTE: a resampling ratio up/down costs a [up, ~51 * max(1, down / up)] filter; a rate coprime to 16 kHz
# (383999 Hz) would need 16000 x 1218 taps (seconds and ~2 GB to build). Ratios are approximated to a
# denominator of at most this (every common rate, e.g. 44100 -> 160/441, stays exact).
MAX_RESAMPLE_DOWN = 1000
FORMATS = ("wav", "flac", "mp3")


class UnsupportedAudioFormat(DecodeError):
    """The bytes are not WAV, FLAC or MP3."""

    code = "unsupported_audio_format"


class CorruptAudio(DecodeError):
    """The header is recognised but the stream cannot be decoded (truncated or damaged)."""

    code = "corrupt_audio"


class EmptyAudio(DecodeError):
    """The file decodes to zero samples."""

    status = 400
    code = "empty_audio"


class BadSampleRate(DecodeError):
    """The declared sample rate is outside [MIN_SAMPLE_RATE, MAX_SAMPLE_RATE]."""

    status = 400
    code = "bad_sample_rate"


class AudioTooLong(MediaTooLarge):
    """The audio is longer than the configured duration limit."""

    code = "audio_too_long"


@dataclass(frozen=True)
class AudioHeader:
    """What the container header says. `duration_s` is None where the header does not tell (MP3)."""

    format: str
    sample_rate: int
    num_channels: int
    duration_s: float | None


@dataclass(frozen=True)
class DecodedAudio:
    """A decoded item: `waveform` is mono float32 `[N]` at `sample_rate` (16 kHz unless asked otherwise)."""

    waveform: torch.Tensor  # [N]
    sample_rate: int
    source_sample_rate: int
    num_channels: int
    format: str

    @property
    def duration_s(self) -> float:
        return self.waveform.numel() / self.sample_rate


# ------------------------------------------------------------------------------------------ header sniffing


def _parse_wav(data: bytes) -> AudioHeader:
    if len(data) < 12:
        raise CorruptAudio("WAV file is truncated (no RIFF header)")
    pos, fmt, data_size = 12, None, None
    while pos + 8 <= len(data) and (fmt is None or data_size is None):
        chunk_id, size = data[pos:pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        if chunk_id == b"fmt " and pos + 24 <= len(data):
            fmt = struct.unpack_from("<HHIIHH", data, pos + 8)  # format, channels, rate, byte rate, align, bits
        elif chunk_id == b"data":
            data_size = min(size, len(data) - pos - 8)  # NOTE: streamed WAVs may declare 0xFFFFFFFF
        pos += 8 + size + (size & 1)
    if fmt is None:
        raise CorruptAudio("WAV file has no 'fmt ' chunk")
    _, num_channels, rate, _, block_align, _ = fmt
    duration = data_size / block_align / rate if data_size is not None and block_align and rate else None
    return AudioHeader("wav", rate, num_channels, duration)


def _skip_id3(data: bytes) -> int:
    """Offset after an ID3v2 tag (0 if there is none)."""
    if data[:3] == b"ID3" and len(data) >= 10:
        size = (data[6] & 0x7F) << 21 | (data[7] & 0x7F) << 14 | (data[8] & 0x7F) << 7 | (data[9] & 0x7F)
        return 10 + size + (10 if data[5] & 0x10 else 0)
    return 0


def _parse_flac(data: bytes, start: int) -> AudioHeader:
    info = data[start + 8:start + 8 + 34]  # STREAMINFO follows "fLaC" + a 4-byte block header
    if len(info) < 18 or data[start + 4] & 0x7F != 0:
        raise CorruptAudio("FLAC file is truncated or has no STREAMINFO block")
    bits = int.from_bytes(info[10:18], "big")  # rate 20 | channels-1 3 | bps-1 5 | total samples 36
    rate, num_channels, total = bits >> 44, ((bits >> 41) & 0x7) + 1, bits & ((1 << 36) - 1)
    return AudioHeader("flac", rate, num_channels, total / rate if total and rate else None)


_MP3_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}  # by MPEG version


def _parse_mp3(data: bytes, start: int) -> AudioHeader | None:
    for pos in range(start, min(len(data) - 4, start + 4096)):
        b0, b1, b2 = data[pos], data[pos + 1], data[pos + 2]
        if b0 != 0xFF or b1 & 0xE0 != 0xE0:
            continue
        version, layer, rate_index = (b1 >> 3) & 3, (b1 >> 1) & 3, (b2 >> 2) & 3
        if version in _MP3_RATES and layer != 0 and rate_index != 3 and b2 >> 4 not in (0, 15):
            num_channels = 1 if data[pos + 3] >> 6 == 3 else 2  # channel mode 3 is mono
            return AudioHeader("mp3", _MP3_RATES[version][rate_index], num_channels, None)
    return None


def sniff_audio(data: bytes) -> AudioHeader:
    """Recognise WAV / FLAC / MP3 from the first bytes.

    Raises:
        UnsupportedAudioFormat: none of the three.
        CorruptAudio: recognised but the header is truncated.
    """
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return _parse_wav(data)
    start = _skip_id3(data)
    if data[start:start + 4] == b"fLaC":
        return _parse_flac(data, start)
    header = _parse_mp3(data, start)
    if header is None:
        raise UnsupportedAudioFormat(f"not a supported audio format (expected {', '.join(FORMATS)}; "
                                     f"starts with {data[:8]!r})")
    return header


# Largest block a FLAC frame header can announce, by its block-size code (0 is reserved).
_FLAC_MAX_BLOCK = np.array([0, 192, 576, 1152, 2304, 4608, 256, 65536, 256, 512, 1024, 2048, 4096, 8192, 16384,
                            32768], dtype=np.int64)
# Samples per MP3 frame by [version (0: MPEG-2.5, 1: reserved, 2: MPEG-2, 3: MPEG-1), layer (1: III, 2: II, 3: I)].
_MP3_FRAME_SAMPLES = np.array([[0, 576, 1152, 384], [0, 0, 0, 0], [0, 576, 1152, 384], [0, 1152, 1152, 384]],
                              dtype=np.int64)
_SCAN_CHUNK = 1 << 20


def max_decoded_samples(data: bytes, fmt: str) -> int:
    """An upper bound on the samples per channel FFmpeg can decode from FLAC or MP3 bytes: every position
    that could start a frame header counts with the largest block that header may announce.

    NOTE: FFmpeg decodes every frame it finds, whatever STREAMINFO claims (and MP3 claims nothing): a 14 KB
    FLAC of constant-value frames decoded to 1.5 GB of samples before the duration check could refuse it.
    """
    a = np.frombuffer(data, np.uint8)
    total = 0
    for pos in range(0, max(len(a) - 3, 0), _SCAN_CHUNK):  # in chunks: the masks stay small
        n = min(_SCAN_CHUNK, len(a) - 3 - pos)
        b0, b1, b2, b3 = (a[pos + k:pos + k + n] for k in range(4))
        if fmt == "flac":  # sync, block size and rate codes not reserved, channel assignment <= 10, zero bit
            found = ((b0 == 0xFF) & (b1 & 0xFE == 0xF8) & (b2 >> 4 != 0) & (b2 & 0x0F != 0x0F) & (b3 >> 4 <= 10)
                     & (b3 & 1 == 0))
            total += int(_FLAC_MAX_BLOCK[b2[found] >> 4].sum())
        else:  # MPEG audio: 11-bit sync, version and layer not reserved, bitrate index not 15, rate index not 3
            found = (b0 == 0xFF) & (b1 & 0xE0 == 0xE0) & (b2 >> 4 != 15) & ((b2 >> 2) & 3 != 3)
            total += int(_MP3_FRAME_SAMPLES[(b1[found] >> 3) & 3, (b1[found] >> 1) & 3].sum())
    return total


# ---------------------------------------------------------------------------------------------- resampling


@lru_cache(maxsize=32)
def _polyphase_filter(up: int, down: int, width: int, rolloff: float, beta: float) -> tuple[torch.Tensor, list[int]]:
    """Per-phase taps `[up, 2 * half]` of a Kaiser-windowed sinc low-pass and each phase's base input offset."""
    cutoff = rolloff * min(1.0, up / down)  # in units of the input Nyquist
    half = math.ceil(width / cutoff)
    phases = np.arange(up)
    base = phases * down // up  # [up]
    frac = (phases * down % up) / up  # [up]: output position minus base, in input samples
    offsets = np.arange(-half + 1, half + 1)  # [2h]
    t = offsets[None, :] - frac[:, None]  # [up, 2h]: tap position relative to the output instant
    window = np.i0(beta * np.sqrt(np.clip(1.0 - (t / half) ** 2, 0.0, None))) / np.i0(beta)
    taps = cutoff * np.sinc(cutoff * t) * window  # [up, 2h]
    return torch.from_numpy(taps.astype(np.float32)), base.tolist()


def resample(waveform: torch.Tensor, orig_sr: int, new_sr: int, width: int = 24, rolloff: float = 0.945,
             beta: float = 14.769656459379492) -> torch.Tensor:
    """Band-limited resampling of `[..., N]` from `orig_sr` to `new_sr` (Kaiser-windowed sinc, polyphase).

    Output length is `ceil(N * new_sr / orig_sr)`; output sample n sits at input time `n * orig_sr / new_sr`.
    `width` zero crossings per side; `rolloff` places the cut-off below the lower Nyquist frequency. A ratio
    whose reduced denominator exceeds `MAX_RESAMPLE_DOWN` is replaced by its closest fraction within it (at
    most 5.1e-4 relative for rates in [4 kHz, 384 kHz]: a pitch change under a cent).
    """
    if orig_sr == new_sr or waveform.shape[-1] == 0:
        return waveform
    ratio = Fraction(new_sr, orig_sr).limit_denominator(MAX_RESAMPLE_DOWN)
    up, down = ratio.numerator, ratio.denominator
    taps, base = _polyphase_filter(up, down, width, rolloff, beta)
    taps = taps.to(waveform.device, waveform.dtype)
    half = taps.shape[1] // 2
    num_in = waveform.shape[-1]
    num_out = -(-num_in * up // down)
    num_blocks = -(-num_out // up)  # blocks of `up` outputs span `down` inputs each
    lead = waveform.shape[:-1]
    x = waveform.reshape(-1, num_in)  # [R, N]
    # NOTE: pad so every window of every block exists: first tap of output n is x[base(n) - half + 1].
    right = num_blocks * down + down + half - num_in
    x = F.pad(x, (half - 1, max(right, 0)))  # [R, N + pad]
    x = x[:, None, :]  # [R, 1, N + pad]
    out = x.new_empty(x.shape[0], num_blocks, up)  # [R, K, up]
    for j in range(up):
        # output k of phase j = x[k * down + base[j] : ... + 2h] . taps[j]
        # NOTE: conv1d wins for few phases (48k -> 16k); many phases with long strides (44.1k: 160 phases,
        # stride 441) run faster as a matmul over the strided windows.
        if up <= 8:
            out[:, :, j] = F.conv1d(x[..., base[j]:], taps[j].view(1, 1, -1), stride=down)[:, 0, :num_blocks]
        else:
            out[:, :, j] = x[:, 0, base[j]:].unfold(-1, 2 * half, down)[:, :num_blocks] @ taps[j]  # [R, K]
    return out.reshape(*lead, num_blocks * up)[..., :num_out]


# ------------------------------------------------------------------------------------------------ decoding


def _decode_wav(data: bytes) -> np.ndarray:
    """PCM (8/16/24/32-bit integer) or IEEE float (32/64-bit) WAV: float32 `[C, N]`, exact."""
    pos, fmt, payload = 12, None, None
    while pos + 8 <= len(data) and payload is None:
        chunk_id, size = data[pos:pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        if chunk_id == b"fmt ":
            if pos + 24 > len(data):
                raise CorruptAudio("WAV 'fmt ' chunk is truncated")
            fmt = struct.unpack_from("<HHIIHH", data, pos + 8)
            if fmt[0] == 0xFFFE and size >= 40 and pos + 34 <= len(data):  # WAVE_FORMAT_EXTENSIBLE: the real
                # tag starts the sub-format GUID
                fmt = (struct.unpack_from("<H", data, pos + 32)[0],) + fmt[1:]
        elif chunk_id == b"data":
            payload = data[pos + 8:pos + 8 + size]
        pos += 8 + size + (size & 1)
    if fmt is None or payload is None:
        raise CorruptAudio("WAV file has no 'fmt ' or 'data' chunk")
    tag, num_channels, _, _, _, bits = fmt
    width = bits // 8
    if num_channels < 1 or bits % 8 or (tag, bits) not in {(1, 8), (1, 16), (1, 24), (1, 32), (3, 32), (3, 64)}:
        raise UnsupportedAudioFormat(f"WAV encoding (format tag {tag}, {bits} bits, {num_channels} channels) is "
                                     "not supported; expected 8/16/24/32-bit PCM or 32/64-bit float")
    num_frames = len(payload) // (width * num_channels)
    raw = np.frombuffer(payload, np.uint8, num_frames * width * num_channels)
    if tag == 3:
        samples = raw.view("<f4" if bits == 32 else "<f8").astype(np.float32)
        if not np.isfinite(samples).all():
            raise CorruptAudio("float WAV contains NaN or infinite samples")
    elif bits == 8:  # unsigned, offset 128
        samples = (raw.astype(np.float32) - 128.0) / 128.0
    else:  # little-endian signed: place the bytes at the top of an int32, then scale
        wide = np.zeros((raw.size // width, 4), np.uint8)
        wide[:, 4 - width:] = raw.reshape(-1, width)
        samples = wide.view("<i4")[:, 0].astype(np.float32) / 2147483648.0
    return samples.reshape(num_frames, num_channels).T  # [C, N]


def _decode_ffmpeg(data: bytes, header: AudioHeader) -> np.ndarray:
    """FLAC / MP3 at the source rate with FFmpeg (decord): float32 `[1, N]`, already downmixed.

    NOTE: decord 0.6 returns garbage for the second plane of planar multi-channel output, so FFmpeg downmixes
    (`mono=True`). For stereo it computes (L + R) / sqrt(2); we rescale that to the mean (L + R) / 2. Sources
    with more than two channels keep FFmpeg's downmix matrix.
    """
    import decord

    try:
        reader = decord.AudioReader(io.BytesIO(data), sample_rate=-1, mono=True)
        samples = np.asarray(reader._array, dtype=np.float32)  # [1, N]; decord has no public whole-stream accessor
    except Exception as e:  # decord raises DECORDError / RuntimeError; its text may echo raw bytes
        raise CorruptAudio(f"cannot decode {header.format.upper()} audio (truncated or damaged stream)") from e
    if header.num_channels == 2:
        samples = samples * np.float32(math.sqrt(0.5))
    return samples


def decode_audio(data: bytes, max_duration_s: float = DEFAULT_MAX_DURATION_S,
                 target_sample_rate: int = TARGET_SAMPLE_RATE) -> DecodedAudio:
    """Decode WAV / FLAC / MP3 bytes to a mono float32 waveform at `target_sample_rate`.

    Channels are averaged (downmix by mean); resampling is band-limited (`resample`).

    Raises:
        UnsupportedAudioFormat, CorruptAudio: not decodable audio (415).
        BadSampleRate: source rate outside [4 kHz, 384 kHz]; EmptyAudio: no samples (400).
        AudioTooLong: longer than `max_duration_s` (413), checked from the header before decoding when it can be.
    """
    header = sniff_audio(data)
    if not MIN_SAMPLE_RATE <= header.sample_rate <= MAX_SAMPLE_RATE:
        raise BadSampleRate(f"{header.format.upper()} sample rate {header.sample_rate} Hz is outside "
                            f"[{MIN_SAMPLE_RATE}, {MAX_SAMPLE_RATE}] Hz")
    _check_duration(header.duration_s, max_duration_s)
    if header.format != "wav":
        _check_duration(max_decoded_samples(data, header.format) / header.sample_rate, max_duration_s, "at most ")
    samples = _decode_wav(data) if header.format == "wav" else _decode_ffmpeg(data, header)  # [C, N]
    if samples.shape[1] == 0:
        raise EmptyAudio(f"{header.format.upper()} audio has no samples")
    _check_duration(samples.shape[1] / header.sample_rate, max_duration_s)
    mono = torch.from_numpy(samples).mean(dim=0)  # [N]
    waveform = resample(mono, header.sample_rate, target_sample_rate).contiguous()  # [N']
    return DecodedAudio(waveform, target_sample_rate, header.sample_rate, header.num_channels, header.format)


def _check_duration(duration_s: float | None, max_duration_s: float, bound: str = "") -> None:
    if duration_s is not None and duration_s > max_duration_s:
        raise AudioTooLong(f"audio is {bound}{duration_s:.1f} s long; the limit is {max_duration_s:g} s")
