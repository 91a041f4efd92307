"""Audio preprocessing: log-mel vs transformers' WhisperFeatureExtractor; decode + resample."""

from __future__ import annotations

import io
import struct
import wave

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor

from preprocess.audio import (
    AudioTooLong,
    BadSampleRate,
    CorruptAudio,
    EmptyAudio,
    UnsupportedAudioFormat,
    decode_audio,
    resample,
    sniff_audio,
)
from preprocess.errors import MediaError
from preprocess.mel import NUM_FRAMES, NUM_WINDOW_SAMPLES, log_mel, log_mel_long, split_windows

SR = 16000


def _signals() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    t_short = np.arange(int(1.7 * SR)) / SR
    t_full = np.arange(NUM_WINDOW_SAMPLES) / SR
    return [
        (0.3 * rng.standard_normal(int(0.5 * SR))).astype(np.float32),  # short noise
        (0.5 * np.sin(2 * np.pi * 440 * t_short)).astype(np.float32),  # short sine
        (0.2 * np.sin(2 * np.pi * 1000 * t_full) + 0.05 * rng.standard_normal(t_full.size)).astype(np.float32),  # 30 s
        (0.1 * rng.standard_normal(12345)).astype(np.float32),  # odd length
    ]


@pytest.mark.parametrize("num_mels", [80, 128])
def test_log_mel_matches_whisper_feature_extractor(num_mels: int) -> None:
    fe = WhisperFeatureExtractor(feature_size=num_mels)
    signals = _signals()
    ours = log_mel([torch.from_numpy(s) for s in signals], num_mels=num_mels, device="cpu")
    assert ours.shape == (len(signals), num_mels, NUM_FRAMES)
    ref = fe(signals, sampling_rate=SR, return_tensors="pt").input_features
    assert (ours - ref).abs().max().item() < 1e-4


def test_log_mel_batched_equals_single() -> None:
    signals = [torch.from_numpy(s) for s in _signals()]
    batched = log_mel(signals)
    for i, s in enumerate(signals):
        assert torch.allclose(log_mel([s])[0], batched[i], atol=1e-5)
    assert torch.allclose(log_mel(torch.stack([signals[0], signals[0]])), log_mel([signals[0]] * 2))


def test_long_audio_split_into_windows() -> None:
    rng = np.random.default_rng(1)
    wav = (0.3 * rng.standard_normal(NUM_WINDOW_SAMPLES * 2 + 5 * SR)).astype(np.float32)  # 65 s
    windows = split_windows(torch.from_numpy(wav))
    assert [w.numel() for w in windows] == [NUM_WINDOW_SAMPLES, NUM_WINDOW_SAMPLES, 5 * SR]
    assert torch.equal(torch.cat(windows), torch.from_numpy(wav))
    ours = log_mel_long(torch.from_numpy(wav), num_mels=80)
    assert ours.shape == (3, 80, NUM_FRAMES)
    fe = WhisperFeatureExtractor(feature_size=80)
    ref = fe([w.numpy() for w in windows], sampling_rate=SR, return_tensors="pt").input_features
    assert (ours - ref).abs().max().item() < 1e-4


def test_split_windows_short_and_bad_shape() -> None:
    wav = torch.zeros(100)
    assert len(split_windows(wav)) == 1
    assert len(split_windows(torch.zeros(NUM_WINDOW_SAMPLES))) == 1
    with pytest.raises(ValueError):
        split_windows(torch.zeros(2, 100))


# ------------------------------------------------------------------------------------------------ decoding

def _tone(sr: int, seconds: float, freq: float = 440.0, channels: int = 1) -> np.ndarray:
    """[N, C] float in [-1, 1): channel c has amplitude 0.5 / (c + 1)."""
    t = np.arange(int(sr * seconds)) / sr
    return np.stack([0.5 / (c + 1) * np.sin(2 * np.pi * freq * t) for c in range(channels)], axis=1)


def _to_pcm(x: np.ndarray, sample_width: int) -> tuple[bytes, np.ndarray]:
    """PCM bytes of `x` [N, C] and the exact float values they encode."""
    scale = float(1 << (8 * sample_width - 1))
    q = np.clip(np.round(x * scale), -scale, scale - 1).astype(np.int64)  # [N, C]
    if sample_width == 1:  # 8-bit WAV is unsigned
        return (q + 128).astype(np.uint8).tobytes(), q / scale
    raw = q.astype("<i4").view(np.uint8).reshape(*q.shape, 4)[..., :sample_width]  # little-endian low bytes
    return raw.tobytes(), q / scale


def _wav(x: np.ndarray, sr: int, sample_width: int = 2) -> tuple[bytes, np.ndarray]:
    pcm, exact = _to_pcm(x, sample_width)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(x.shape[1])
        w.setsampwidth(sample_width)
        w.setframerate(sr)
        w.writeframes(pcm)
    return buf.getvalue(), exact


def _crc8(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = ((crc << 1) ^ 0x07) & 0xFF if crc & 0x80 else (crc << 1) & 0xFF
    return crc


def _crc16(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x8005) & 0xFFFF if crc & 0x8000 else (crc << 1) & 0xFFFF
    return crc


def _flac(x: np.ndarray, sr: int, block: int = 4096) -> tuple[bytes, np.ndarray]:
    """A minimal 16-bit FLAC file (VERBATIM subframes) of `x` [N, C]: enough to exercise a real FLAC decoder."""
    q = np.clip(np.round(x * 32768), -32768, 32767).astype(">i2")  # [N, C]
    num, ch = q.shape
    assert num // block < 128  # frame numbers fit a one-byte UTF-8 code
    info = struct.pack(">HH", block, block) + b"\0" * 6
    info += ((sr << 44) | ((ch - 1) << 41) | (15 << 36) | num).to_bytes(8, "big") + b"\0" * 16
    out = b"fLaC" + bytes([0x80]) + len(info).to_bytes(3, "big") + info
    for i, start in enumerate(range(0, num, block)):
        chunk = q[start:start + block]
        header = bytes([0xFF, 0xF8, 0x70, ((ch - 1) << 4) | 0x08, i]) + struct.pack(">H", len(chunk) - 1)
        frame = header + bytes([_crc8(header)])
        frame += b"".join(b"\x02" + chunk[:, c].tobytes() for c in range(ch))
        out += frame + struct.pack(">H", _crc16(frame))
    return out, q.astype(np.float64) / 32768


def _expected(exact: np.ndarray, sr: int) -> torch.Tensor:
    return resample(torch.from_numpy(exact.mean(axis=1).astype(np.float32)), sr, 16000)


@pytest.mark.parametrize("sr", [8000, 16000, 44100, 48000])
@pytest.mark.parametrize("sample_width", [1, 2, 3, 4])
def test_decode_wav(sr: int, sample_width: int) -> None:
    data, exact = _wav(_tone(sr, 0.5, channels=2), sr, sample_width)
    audio = decode_audio(data)
    assert (audio.format, audio.source_sample_rate, audio.num_channels, audio.sample_rate) == ("wav", sr, 2, 16000)
    assert audio.waveform.dtype == torch.float32 and audio.waveform.shape == (8000,)
    tol = 2.0 ** -6 if sample_width == 1 else 1e-4
    assert (audio.waveform - _expected(exact, sr)).abs().max().item() < tol
    # the downmixed tone: amplitude (0.5 + 0.25) / 2, away from the edges
    ref = 0.375 * np.sin(2 * np.pi * 440 * np.arange(8000) / 16000)
    assert np.abs(audio.waveform.numpy() - ref)[500:-500].max() < max(tol, 1e-3)


def test_decode_flac() -> None:
    sr = 44100
    data, exact = _flac(_tone(sr, 0.3, channels=2), sr)
    assert sniff_audio(data).format == "flac"
    audio = decode_audio(data)
    assert (audio.format, audio.source_sample_rate, audio.num_channels) == ("flac", sr, 2)
    assert (audio.waveform - _expected(exact, sr)).abs().max().item() < 1e-4


def _mp3(samples: np.ndarray, sr: int) -> bytes:
    """Encode a [N, C] float tone as MP3 with PyAV's bundled libmp3lame."""
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp3") as container:
        stream = container.add_stream("libmp3lame", rate=sr, layout="stereo" if samples.shape[1] == 2 else "mono")
        planar = np.ascontiguousarray(samples.T.astype(np.float32))  # [C, N]
        for start in range(0, planar.shape[1], 1152):
            frame = av.AudioFrame.from_ndarray(planar[:, start:start + 1152], format="fltp",
                                               layout=stream.layout.name)
            frame.sample_rate = sr
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buf.getvalue()


def test_decode_mp3() -> None:
    sr = 22050
    data = _mp3(_tone(sr, 1.5, channels=2), sr)
    audio = decode_audio(data)
    assert (audio.format, audio.source_sample_rate, audio.sample_rate) == ("mp3", sr, 16000)
    assert abs(audio.duration_s - 1.5) < 0.1  # MP3 adds encoder delay and frame padding
    wave = audio.waveform.numpy()
    spectrum = np.abs(np.fft.rfft(wave[4000:20000]))
    assert abs(np.argmax(spectrum) - 440) < 2  # 16000 samples at 16 kHz: bins 1 Hz apart; the 440 Hz tone survived
    assert 0.2 < np.abs(wave[4000:20000]).max() < 0.5  # mean of channels at 0.5 and 0.25 amplitude


def test_resample_rejects_above_nyquist() -> None:
    x = torch.from_numpy(_tone(48000, 0.5, freq=12000.0)[:, 0].astype(np.float32))
    assert resample(x, 48000, 16000)[200:-200].abs().max() < 1e-3


def test_decode_errors() -> None:
    with pytest.raises(UnsupportedAudioFormat, match="not a supported audio format"):
        decode_audio(b"definitely not audio" * 10)
    for other in (b"\x89PNG\r\n\x1a\n" + bytes(64), b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + bytes(64), b""):
        with pytest.raises(MediaError):
            decode_audio(other)
    float_wav = bytearray(_wav(_tone(16000, 0.1), 16000, 4)[0])
    float_wav[20:22] = struct.pack("<H", 3)  # the same 32-bit payload declared IEEE float ...
    tone = _tone(16000, 0.1)[:, 0].astype("<f4")
    float_wav[44:] = tone.tobytes()  # ... and replaced by float samples: decodes exactly (rate unchanged)
    assert np.array_equal(decode_audio(bytes(float_wav)).waveform.numpy(), tone)
    float_wav[44:48] = np.float32(np.nan).tobytes()
    with pytest.raises(CorruptAudio, match="NaN"):
        decode_audio(bytes(float_wav))
    adpcm = bytearray(float_wav)
    adpcm[20:22] = struct.pack("<H", 2)
    with pytest.raises(UnsupportedAudioFormat, match="format tag 2"):
        decode_audio(bytes(adpcm))
    with pytest.raises(EmptyAudio, match="no samples"):
        decode_audio(_wav(np.zeros((0, 1)), 16000)[0])
    with pytest.raises(BadSampleRate, match="sample rate 1000 Hz"):
        decode_audio(_wav(_tone(1000, 0.1), 1000)[0])
    with pytest.raises(BadSampleRate):
        decode_audio(_wav(_tone(16000, 0.1), 1_000_000)[0])
    with pytest.raises(AudioTooLong, match="limit is 1 s") as info:
        decode_audio(_wav(_tone(16000, 2.0), 16000)[0], max_duration_s=1.0)
    assert info.value.status == 413
    with pytest.raises(CorruptAudio):
        decode_audio(b"RIFF\0\0\0\0WAVE")
    flac, _ = _flac(_tone(16000, 0.2), 16000)
    with pytest.raises(MediaError):
        decode_audio(flac[:30])  # STREAMINFO cut short
    for cls in (UnsupportedAudioFormat, EmptyAudio, BadSampleRate, AudioTooLong, CorruptAudio):
        assert issubclass(cls, MediaError) and 400 <= cls.status < 500
