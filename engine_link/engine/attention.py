"""Attention over the paged KV pools.

A forward runs on a packed batch of T token positions from many sequences (prefill chunks and decode
tokens). New K/V are written to their slots first, then each query attends to K/V gathered by slot:
full-attention layers from the full pool (positions 0..pos), SWA layers from the SWA pool (the last
`window` positions, the query included) plus a per-head attention sink.

Queries are grouped by query length so that no group pads queries: all decode tokens (one query each) form
one group, prefill chunks of equal length another; keys are padded to the group's longest context and masked.
Each group runs one `scaled_dot_product_attention` call (math kernel on CPU; the memory-efficient kernel
with a mask on CUDA).

NOTE (sinks): softmax over [scores, sink_h] with the sink column dropped equals attention over one extra
key with a zero value whose score is sink_h. We add that key by giving q one extra channel holding
sink_h / scale and the sink key a 1 there (real keys 0), so grouped-query sharing of K/V stays intact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine_link.engine.config import EngineModelConfig
from engine_link.engine.layers import apply_rotary


@dataclass
class KVView:
    """One group's view of one pool: which slots to gather and which of them each query may see."""

    slots: torch.Tensor  # [B, S] int64 (padding points at slot 0 and is masked out)
    mask: torch.Tensor  # [B, 1, L, S] bool, or [B, 1, L, S + 1] with the always-visible sink column (SWA)


@dataclass
class AttnGroup:
    rows: torch.Tensor  # [B * L] packed row of each query, in [B, L] order
    batch: int
    q_len: int
    full: KVView
    swa: KVView


@dataclass
class AttnMetadata:
    groups: list[AttnGroup]
    full_write: torch.Tensor  # [T] full-pool slot of each new token
    swa_write: torch.Tensor  # [T] SWA-pool slot of each new token


def build_group(rows: torch.Tensor, q_starts: list[int], q_len: int, full_tables: list[torch.Tensor],
                swa_tables: list[torch.Tensor], window: int, device: torch.device) -> AttnGroup:
    """Metadata of B sequences that each bring `q_len` queries at positions q_start..q_start+q_len-1.

    Args:
        rows: [B * q_len] packed rows of the queries.
        q_starts: first query position per sequence.
        full_tables: per sequence, full-pool slots of positions 0..q_start+q_len-1.
        swa_tables: per sequence, SWA-pool slots of positions max(0, q_start-window+1)..q_start+q_len-1.
        window: keys a SWA query sees, itself included.
    """
    batch = len(q_starts)
    qpos = torch.tensor(q_starts)[:, None] + torch.arange(q_len)[None, :]  # [B, L]

    def view(tables: list[torch.Tensor], kv_starts: list[int], is_swa: bool) -> KVView:
        num_keys = max(t.numel() for t in tables)
        slots = torch.zeros(batch, num_keys, dtype=torch.int64)
        for b, t in enumerate(tables):
            slots[b, :t.numel()] = t
        kpos = torch.tensor(kv_starts)[:, None] + torch.arange(num_keys)[None, :]  # [B, S]
        valid = torch.arange(num_keys)[None, :] < torch.tensor([t.numel() for t in tables])[:, None]  # [B, S]
        mask = (kpos[:, None, :] <= qpos[:, :, None]) & valid[:, None, :]  # [B, L, S]
        if is_swa:
            mask &= kpos[:, None, :] > qpos[:, :, None] - window
            mask = torch.cat([mask, torch.ones(batch, q_len, 1, dtype=torch.bool)], dim=-1)  # sink column
        return KVView(slots.to(device), mask[:, None].to(device))

    swa_starts = [max(0, s - window + 1) for s in q_starts]
    return AttnGroup(rows.to(device), batch, q_len, view(full_tables, [0] * batch, False),
                     view(swa_tables, swa_starts, True))


class Attention(nn.Module):
    def __init__(self, cfg: EngineModelConfig, layer: int) -> None:
        super().__init__()
        self.is_swa = cfg.is_swa(layer)
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_kv_heads(layer)
        self.head_dim, self.v_head_dim = cfg.head_dim, cfg.v_head_dim
        self.scaling = cfg.head_dim ** -0.5
        self.v_scale = cfg.attention_value_scale
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.v_head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, cfg.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if self.is_swa else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """x: [T, D]; k_cache: [num_slots, Hkv, Dh]; v_cache: [num_slots, Hkv, Dv] -> [T, D]."""
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)  # [T, H, Dh]
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, Dh]
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.v_head_dim) * self.v_scale  # [T, Hkv, Dv]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        write = meta.swa_write if self.is_swa else meta.full_write
        k_cache[write] = k.to(k_cache.dtype)
        v_cache[write] = v.to(v_cache.dtype)
        out = torch.empty(num_tokens, self.num_heads, self.v_head_dim, dtype=x.dtype, device=x.device)
        for g in meta.groups:
            kv = g.swa if self.is_swa else g.full
            qg = q[g.rows].view(g.batch, g.q_len, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, L, Dh]
            kg = k_cache[kv.slots].transpose(1, 2)  # [B, Hkv, S, Dh]
            vg = v_cache[kv.slots].transpose(1, 2)  # [B, Hkv, S, Dv]
            if self.sinks is not None:
                qg, kg, vg = self._add_sink(qg, kg, vg)
            gqa = not qg.is_cuda
            if not gqa:  # NOTE: CUDA's memory-efficient kernel takes a mask but not enable_gqa: expand kv heads
                groups = self.num_heads // self.num_kv_heads
                kg, vg = kg.repeat_interleave(groups, dim=1), vg.repeat_interleave(groups, dim=1)  # [B, H, S, .]
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=kv.mask, scale=self.scaling,
                                               enable_gqa=gqa)  # [B, H, L, Dv]
            out[g.rows] = o.transpose(1, 2).reshape(-1, self.num_heads, self.v_head_dim)
        return self.o_proj(out.view(num_tokens, -1))

    def _add_sink(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append the sink as one extra key (see module NOTE); pads head dim to a multiple of 8."""
        batch, _, q_len, dim = q.shape
        num_keys = k.shape[2]
        pad = (dim + 1 + 7) // 8 * 8 - dim
        sink_q = (self.sinks.to(q.dtype) / self.scaling).view(1, -1, 1, 1).expand(batch, -1, q_len, 1)
        q = torch.cat([q, sink_q, q.new_zeros(batch, self.num_heads, q_len, pad - 1)], dim=-1)  # [B, H, L, Dp]
        k = F.pad(k, (0, pad, 0, 1))  # [B, Hkv, S + 1, Dp]; the sink key is the last, all zeros so far
        k[:, :, num_keys, dim] = 1.0
        v = F.pad(v, (0, 0, 0, 1))  # [B, Hkv, S + 1, Dv]; the sink's value is zero
        return q, k, v
