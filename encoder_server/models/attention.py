"""Non-causal attention over packed variable-length segments (`cu_seqlens`), no padding.

Backends (a tiny registry, chosen per device):
- `flash`: `torch.nn.attention.varlen.varlen_attn` (FlashAttention varlen kernel, CUDA only).
- `sdpa`: segments grouped by length and run as one batched `scaled_dot_product_attention` per distinct
  length. Windowed blocks have few distinct lengths, so this is a handful of calls, not one per segment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SegmentGroup:
    """All segments of one length, as a gather index into the packed sequence."""

    length: int
    index: torch.Tensor  # [num_segments * length] int64 on the compute device


@dataclass(frozen=True)
class Segments:
    """Packed segment layout: `cu_seqlens` for kernels that take it, length groups for batched SDPA."""

    cu_seqlens: torch.Tensor  # [num_segments + 1] int32 on the compute device
    max_seqlen: int
    groups: tuple[SegmentGroup, ...]

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device, with_groups: bool) -> Segments:
        lengths_t = torch.tensor(lengths, dtype=torch.int64)
        starts = torch.cumsum(lengths_t, 0) - lengths_t
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lengths_t, 0)
        groups: list[SegmentGroup] = []
        if with_groups:
            for length in torch.unique(lengths_t).tolist():
                seg_starts = starts[lengths_t == length]  # [S]
                index = (seg_starts[:, None] + torch.arange(length)).reshape(-1)  # [S * L]
                groups.append(SegmentGroup(int(length), index.to(device, non_blocking=True)))
        return cls(cu.to(device, non_blocking=True), int(max(lengths)), tuple(groups))


AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Segments, float], torch.Tensor]


def sdpa_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments, scale: float) -> torch.Tensor:
    """q, k, v: [T, H, D] -> [T, H, D]; attention only within each segment."""
    out = torch.empty_like(q)
    num_heads, head_dim = q.shape[1], q.shape[2]
    for group in seg.groups:
        shape = (-1, group.length, num_heads, head_dim)
        qs, ks, vs = (x.index_select(0, group.index).view(shape).transpose(1, 2) for x in (q, k, v))  # [S, H, L, D]
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)  # [S, H, L, D]
        out.index_copy_(0, group.index, o.transpose(1, 2).reshape(-1, num_heads, head_dim))
    return out


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments, scale: float) -> torch.Tensor:
    """q, k, v: [T, H, D] (CUDA, fp16/bf16) -> [T, H, D] via the FlashAttention varlen kernel."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, seg.cu_seqlens, seg.cu_seqlens, seg.max_seqlen, seg.max_seqlen, scale=scale)


_BACKENDS: dict[str, AttentionFn] = {"sdpa": sdpa_varlen, "flash": flash_varlen}


def flash_available(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """`auto` -> `flash` where it can run, else `sdpa`. An explicit name is checked and returned."""
    if name == "auto":
        return "flash" if flash_available(device, dtype) else "sdpa"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}")
    if name == "flash" and not flash_available(device, dtype):
        raise ValueError(f"flash attention needs CUDA and fp16/bf16, got {device} {dtype}")
    return name


def get_backend(name: str) -> AttentionFn:
    return _BACKENDS[name]
