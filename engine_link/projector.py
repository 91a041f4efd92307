"""Encoder embeddings -> the LLM's hidden size.

When an encoder's width equals the LLM's hidden size (a Qwen2.5-VL ViT's merger already projects to it), the
embedding goes in unchanged. Otherwise (the tiny presets: ViT 128, audio 64, LLM 64) a seeded random linear
layer per (modality, width) maps it, so the tiny stack runs end to end; a real pairing of a checkpoint with
different widths needs its trained projector, which this does not load.
"""

from __future__ import annotations

import hashlib

import torch


class Projector:
    def __init__(self, hidden_size: int, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
        self.hidden_size, self.device, self.dtype, self.seed = hidden_size, device, dtype, seed
        self._layers: dict[tuple[str, int], torch.Tensor] = {}

    @torch.inference_mode()
    def __call__(self, modality: str, embedding: torch.Tensor) -> torch.Tensor:
        """`[n, width]` -> `[n, hidden_size]` on the engine's device and dtype."""
        x = embedding.to(self.device, self.dtype)
        width = x.shape[-1]
        if width == self.hidden_size:
            return x
        key = (modality, width)
        if key not in self._layers:
            tag = int.from_bytes(hashlib.blake2b(f"{modality}:{width}".encode(), digest_size=4).digest(), "big")
            gen = torch.Generator().manual_seed(self.seed ^ tag)
            weight = torch.randn(width, self.hidden_size, generator=gen) / width**0.5  # [width, hidden]
            self._layers[key] = weight.to(self.device, self.dtype)
        return x @ self._layers[key]  # [n, hidden]
