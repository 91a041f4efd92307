"""Whisper-style audio encoder over batches of 30 s log-mel windows.

Parameter names equal transformers' `WhisperEncoder` (conv1, conv2, embed_positions, layers.*, layer_norm), so
an encoder saved with `save_pretrained`, or the `encoder.*` / `model.encoder.*` part of a Whisper checkpoint,
loads unchanged. Attention runs through `F.scaled_dot_product_attention`; every window is a full 1500-token
sequence (Whisper has no padding mask), so a batch is one dense `[B, H, T, D]` call.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from encoder_server.config import AUDIO_PRESETS, AudioConfig
from encoder_server.models.loader import init_random, load_weights, read_state_dict, weights_fingerprint

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}

# Prefixes under which the encoder's weights appear: WhisperForConditionalGeneration, WhisperModel, WhisperEncoder.
_PREFIXES = ("model.encoder.", "encoder.", "")


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's sinusoidal position table `[length, channels]`: sin half, then cos half."""
    log_increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_increment * torch.arange(channels // 2))  # [C/2]
    scaled_time = torch.arange(length)[:, None] * inv_timescales[None, :]  # [L, C/2]
    return torch.cat([scaled_time.sin(), scaled_time.cos()], dim=1)  # [L, C]


class AudioAttention(nn.Module):
    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        self.num_heads = cfg.encoder_attention_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=True)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)  # NOTE: Whisper's key projection has no bias
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=True)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, num_tokens, _ = x.shape
        shape = (batch, num_tokens, self.num_heads, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)  # [B, H, T, D]
        k = self.k_proj(x).view(shape).transpose(1, 2)  # [B, H, T, D]
        v = self.v_proj(x).view(shape).transpose(1, 2)  # [B, H, T, D]
        out = F.scaled_dot_product_attention(q, k, v)  # [B, H, T, D]
        return self.out_proj(out.transpose(1, 2).reshape(batch, num_tokens, -1))  # [B, T, E]


class AudioEncoderLayer(nn.Module):
    """Pre-LN block: x + attn(LN(x)), then x + fc2(act(fc1(LN(x))))."""

    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        self.self_attn = AudioAttention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)
        self.act = _ACTIVATIONS[cfg.activation_function]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        x = x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))
        if x.dtype == torch.float16:  # as transformers: keep fp16 activations finite
            limit = torch.finfo(x.dtype).max - 1000
            x = x.clamp(-limit, limit)
        return x


class AudioEncoder(nn.Module):
    """Whisper encoder. `forward(input_features [B, num_mels, 3000]) -> [B, 1500, d_model]`."""

    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, cfg.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(cfg.d_model, cfg.d_model, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, cfg.d_model)
        self.layers = nn.ModuleList(AudioEncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.layer_norm = nn.LayerNorm(cfg.d_model)

    def prepare_for_inference(self) -> AudioEncoder:
        """Eval mode, no gradients. Call after moving to the final device and dtype."""
        self.eval().requires_grad_(False)
        return self

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        """Encode a batch of log-mel windows.

        Args:
            input_features: `[B, num_mel_bins, 2 * max_source_positions]` (`preprocess.mel.log_mel` output).
        Returns:
            `[B, max_source_positions, d_model]`, one row of tokens per window.
        """
        expected = (self.cfg.num_mel_bins, self.cfg.num_frames)
        if input_features.dim() != 3 or tuple(input_features.shape[1:]) != expected:
            raise ValueError(f"audio encoder expects [B, {expected[0]}, {expected[1]}] features, "
                             f"got {tuple(input_features.shape)}")
        weight = self.conv1.weight
        x = input_features.to(weight.device, weight.dtype, non_blocking=True)  # [B, M, 2T]
        x = F.gelu(self.conv1(x))  # [B, E, 2T]
        x = F.gelu(self.conv2(x))  # [B, E, T]
        x = x.transpose(1, 2) + self.embed_positions.weight  # [B, T, E]
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)  # [B, T, E]


# -------------------------------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class LoadedAudio:
    model: AudioEncoder
    cfg: AudioConfig
    fingerprint: str  # architecture + weights identity (for cache keys)


def _encoder_weights(state: dict[str, torch.Tensor], directory: Path) -> dict[str, torch.Tensor]:
    for prefix in _PREFIXES:
        if prefix + "conv1.weight" in state:
            return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    raise ValueError(f"{directory}: no Whisper encoder weights (looked for *conv1.weight)")


def load_audio(spec: str, device: torch.device, dtype: torch.dtype) -> LoadedAudio:
    """Load `spec`: a preset name from AUDIO_PRESETS (seeded random weights, sinusoidal positions), or a
    directory with a Whisper config.json + safetensors (WhisperEncoder, WhisperModel or
    WhisperForConditionalGeneration layout).

    Raises:
        ValueError: unknown preset, unreadable directory, or weights that do not fit the config.
    """
    if spec in AUDIO_PRESETS:
        cfg = AUDIO_PRESETS[spec]
        model = AudioEncoder(cfg)
        init_random(model, cfg.seed)
        with torch.no_grad():
            model.embed_positions.weight.copy_(sinusoids(cfg.max_source_positions, cfg.d_model))
        fingerprint = hashlib.blake2b(f"audio-preset:{spec}:{cfg!r}".encode(), digest_size=16).hexdigest()
    else:
        directory = Path(spec)
        config_path = directory / "config.json"
        if not config_path.is_file():
            raise ValueError(f"{spec!r} is neither a preset {sorted(AUDIO_PRESETS)} nor a directory with config.json")
        cfg = AudioConfig.from_hf_dict(json.loads(config_path.read_text()))
        model = AudioEncoder(cfg)
        weights = _encoder_weights(read_state_dict(directory), directory)
        load_weights(model, weights, directory)
        fingerprint = weights_fingerprint(cfg, weights)
    model = model.to(device=device, dtype=dtype).prepare_for_inference()
    return LoadedAudio(model, cfg, fingerprint)
