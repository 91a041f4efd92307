"""Small building blocks of the MiMo-V2-Flash decoder: RMSNorm, partial rotary embedding, dense SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_link.engine.config import FULL, SWA, EngineModelConfig


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalized in float32, scaled in x's dtype (as transformers' MiMo-V2-Flash RMSNorm)."""
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin of partial rotary embedding, one frequency table per layer type (full and SWA have their own theta).

    NOTE: only the first `rotary_dim` channels of q/k rotate (half-split `rotate_half` convention).
    """

    def __init__(self, cfg: EngineModelConfig) -> None:
        super().__init__()
        for kind, theta, factor in ((FULL, cfg.rope_theta_full, cfg.partial_rotary_factor_full),
                                    (SWA, cfg.rope_theta_swa, cfg.partial_rotary_factor_swa)):
            dim = int(cfg.head_dim * factor)
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))  # [rot / 2]
            self.register_buffer(f"{kind}_inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = getattr(self, f"{kind}_inv_freq")
        freqs = positions[:, None].float() * inv_freq.float()  # [T, rot / 2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, rot]: broadcast over heads
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, 1, rot] with rot <= D; the last D - rot channels pass through."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)


class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
