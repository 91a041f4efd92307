"""Model inputs of one forward, per modality, and the audio token arithmetic.

- image / video: patches for the ViT, `[P, C * tp * ps * ps]`, with one (t, h, w) grid per item;
- audio: Whisper log-mel windows `[W, num_mels, 3000]`; each item is cut into 30 s windows, and only the
  tokens whose frames lie inside the audio are kept (the padding of the last window is dropped).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from preprocess.mel import HOP_LENGTH, NUM_WINDOW_SAMPLES, log_mel, split_windows

Grid = tuple[int, int, int]


@dataclass
class EncodeInputs:
    """What one forward consumes (exactly one of `pixel_values` / `features` is set)."""

    pixel_values: torch.Tensor | None = None  # vision: [P, patch_dim] on the device
    grids: list[Grid] = field(default_factory=list)  # vision: one per item
    features: torch.Tensor | None = None  # audio: [W, num_mels, 3000] on the device
    window_tokens: list[int] = field(default_factory=list)  # audio: kept tokens per window, items in order


def audio_window_tokens(num_samples: int, positions: int) -> list[int]:
    """Tokens kept per 30 s window of a 16 kHz waveform of `num_samples` samples.

    A window of n samples has ceil(n / hop) mel frames; the encoder's stride-2 conv turns L frames into
    ceil(L / 2) tokens (of `positions` per full window).
    """
    out = []
    for start in range(0, max(num_samples, 1), NUM_WINDOW_SAMPLES):
        n = min(NUM_WINDOW_SAMPLES, num_samples - start)
        frames = max(1, -(-n // HOP_LENGTH))
        out.append(min(positions, -(-frames // 2)))
    return out


def audio_inputs(waveforms: list[torch.Tensor], window_tokens: list[list[int]], num_mels: int,
                 device: torch.device) -> EncodeInputs:
    """Log-mel of every window of every item, batched on `device`."""
    windows = [w for wav in waveforms for w in split_windows(wav)]
    features = log_mel(windows, num_mels, device)  # [W, num_mels, 3000]
    return EncodeInputs(features=features, window_tokens=[n for item in window_tokens for n in item])


def audio_forward(model: torch.nn.Module, inputs: EncodeInputs) -> torch.Tensor:
    """Encode the windows and pack the kept tokens of all windows: `[sum(window_tokens), D]`."""
    out = model(inputs.features)  # [W, positions, D]
    positions = out.shape[1]
    keep = torch.cat([w * positions + torch.arange(n) for w, n in enumerate(inputs.window_tokens)])  # [T]
    keep = keep.to(out.device, non_blocking=True)
    return out.reshape(-1, out.shape[-1]).index_select(0, keep)  # [T, D]
