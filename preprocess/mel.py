"""Whisper log-mel features, batched on the device.

Computes what transformers' `WhisperFeatureExtractor` computes (Hann window, n_fft 400, hop 160, Slaney
mel filters 0..8 kHz, power spectrum, log10 clamped at 1e-10, dynamic range cut at max - 8 per window,
`(x + 4) / 4`), for a whole batch of 30 s windows in one `torch.stft`.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30
NUM_WINDOW_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # 480000
NUM_FRAMES = NUM_WINDOW_SAMPLES // HOP_LENGTH  # 3000


@lru_cache(maxsize=8)
def _mel_filters_np(num_mels: int) -> np.ndarray:
    from transformers.audio_utils import mel_filter_bank

    return mel_filter_bank(  # [n_fft/2 + 1, num_mels], same arguments as WhisperFeatureExtractor
        num_frequency_bins=1 + N_FFT // 2,
        num_mel_filters=num_mels,
        min_frequency=0.0,
        max_frequency=8000.0,
        sampling_rate=SAMPLE_RATE,
        norm="slaney",
        mel_scale="slaney",
    )


@lru_cache(maxsize=16)
def mel_filters(num_mels: int, device: torch.device) -> torch.Tensor:
    """Slaney mel filter bank as float32 `[num_mels, n_fft/2 + 1]` on `device` (computed once per device)."""
    return torch.from_numpy(_mel_filters_np(num_mels)).to(device, torch.float32).T.contiguous()


@lru_cache(maxsize=4)
def _hann(device: torch.device) -> torch.Tensor:
    return torch.hann_window(N_FFT, device=device)  # [n_fft], periodic as in transformers


def split_windows(waveform: torch.Tensor, sr: int = SAMPLE_RATE) -> list[torch.Tensor]:
    """Cut a mono waveform `[N]` into consecutive 30 s windows; the last one may be shorter (not padded).

    An empty waveform gives one empty window (it becomes silence in `log_mel`).
    """
    if waveform.dim() != 1:
        raise ValueError(f"split_windows expects a mono waveform [N], got shape {tuple(waveform.shape)}")
    window = CHUNK_SECONDS * sr
    if waveform.numel() <= window:
        return [waveform]
    return list(waveform.split(window))


def _pad_batch(waveforms: list[torch.Tensor] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Stack waveforms into `[B, 480000]` on `device`: zero-padded (silence) or truncated to 30 s."""
    if isinstance(waveforms, torch.Tensor):
        if waveforms.dim() != 2:
            raise ValueError(f"log_mel expects [B, N] or a list of [N], got shape {tuple(waveforms.shape)}")
        waveforms = list(waveforms.unbind(0))
    if not waveforms:
        raise ValueError("log_mel needs at least one waveform")
    batch = torch.zeros(len(waveforms), NUM_WINDOW_SAMPLES, dtype=torch.float32, device=device)  # [B, 480000]
    for i, wav in enumerate(waveforms):
        if wav.dim() != 1:
            raise ValueError(f"waveform {i} must be mono [N], got shape {tuple(wav.shape)}")
        n = min(wav.numel(), NUM_WINDOW_SAMPLES)
        batch[i, :n] = wav[:n].to(device, torch.float32, non_blocking=True)
    return batch


def log_mel(waveforms: list[torch.Tensor] | torch.Tensor, num_mels: int = 80,
            device: torch.device | str | None = None) -> torch.Tensor:
    """Whisper log-mel spectrogram of a batch of 16 kHz mono windows.

    Args:
        waveforms: list of `[N]` tensors or one `[B, N]` tensor, 16 kHz mono. Each is zero-padded or truncated to
            30 s (use `split_windows` first for longer audio).
        num_mels: 80 (Whisper up to large-v2) or 128 (large-v3).
        device: where to compute; default: the device of the first waveform.
    Returns:
        float32 `[B, num_mels, 3000]` on `device`, equal to `WhisperFeatureExtractor(feature_size=num_mels)`.
    """
    if device is None:
        first = waveforms[0] if isinstance(waveforms, list) and waveforms else waveforms
        device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
    device = torch.device(device)
    batch = _pad_batch(waveforms, device)  # [B, 480000]
    stft = torch.stft(batch, N_FFT, HOP_LENGTH, window=_hann(device), return_complex=True)  # [B, 201, 3001]
    power = stft[..., :-1].abs().pow(2).contiguous()  # [B, 201, 3000]
    mel = mel_filters(num_mels, device) @ power  # [B, num_mels, 3000]
    log_spec = mel.clamp(min=1e-10).log10()
    # NOTE: the dynamic-range cut is per window (per batch row), as in WhisperFeatureExtractor.
    max_val = log_spec.amax(dim=(1, 2), keepdim=True)  # [B, 1, 1]
    log_spec = torch.maximum(log_spec, max_val - 8.0)
    return (log_spec + 4.0) / 4.0


def log_mel_long(waveform: torch.Tensor, num_mels: int = 80, device: torch.device | str | None = None) -> torch.Tensor:
    """Log-mel of one mono waveform of any length: `[num_windows, num_mels, 3000]`, one row per 30 s window."""
    return log_mel(split_windows(waveform), num_mels, device)


__all__ = ["log_mel", "log_mel_long", "mel_filters", "split_windows"]
