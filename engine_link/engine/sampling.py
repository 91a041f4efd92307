"""Sampling parameters and the sampler: greedy at temperature 0, else temperature, top-k, top-p."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling (vLLM names). `seed` makes a sampled request reproducible on its own."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    return_logits: bool = False  # keep the float32 logits of every generated token (tests, debugging)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
           ) -> list[int]:
    """logits: [N, V] float32, one row per request -> N token ids."""
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for i, p in enumerate(params):
        if p.is_greedy:
            out.append(greedy[i])
            continue
        row = logits[i] / p.temperature  # [V]
        if p.top_k:
            kth = row.topk(min(p.top_k, row.numel()))[0][-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = row.softmax(dim=-1)
        if p.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            drop = sorted_probs.cumsum(0) - sorted_probs > p.top_p  # keep the smallest head reaching top_p
            probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        out.append(int(torch.multinomial(probs, 1, generator=generators[i]).item()))
    return out
