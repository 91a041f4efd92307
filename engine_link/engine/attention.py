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
key with a zero value whose score is sink_h. That key is the SWA pool's last row, which stays zero (no
slot maps to it): its q.k is 0, and the group's additive float mask puts sink_h in its column (2 ops per
layer, no copies of q, K or V).
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

    slots: torch.Tensor  # [B, S] int64 (padding points at slot 0 and is masked out); SWA: [B, S + 1], sink last
    mask: torch.Tensor  # [B, 1, L, S] bool; SWA: [B, 1, L, S + 1] float, 0 visible, -inf hidden, 0 for the sink
    sink_column: torch.Tensor | None = None  # SWA: [S + 1] float, 1 at the sink's column (see module NOTE)


@dataclass
class AttnGroup:
    rows: torch.Tensor | None  # [B * L] packed row of each query, in [B, L] order; None: all rows, in order
    batch: int
    q_len: int
    full: KVView
    swa: KVView


@dataclass
class AttnMetadata:
    groups: list[AttnGroup]
    full_write: torch.Tensor  # [T] full-pool slot of each new token
    swa_write: torch.Tensor  # [T] SWA-pool slot of each new token


def build_group(rows: torch.Tensor | None, q_starts: list[int], q_len: int, full_tables: list[torch.Tensor],
                swa_tables: list[torch.Tensor], window: int, sink_slot: int, device: torch.device,
                dtype: torch.dtype) -> AttnGroup:
    """Metadata of B sequences that each bring `q_len` queries at positions q_start..q_start+q_len-1.

    Args:
        rows: [B * q_len] packed rows of the queries; None when the group is the whole batch, in order.
        q_starts: first query position per sequence.
        full_tables: per sequence, full-pool slots of positions 0..q_start+q_len-1.
        swa_tables: per sequence, SWA-pool slots of positions max(0, q_start-window+1)..q_start+q_len-1.
        window: keys a SWA query sees, itself included.
        sink_slot: the SWA pool's always-zero row (the sink key).
        dtype: of the queries (the SWA mask is additive, so it takes their dtype).
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
        if not is_swa:
            return KVView(slots.to(device), mask[:, None].to(device))
        mask &= kpos[:, None, :] > qpos[:, :, None] - window
        additive = torch.zeros(batch, q_len, num_keys + 1).masked_fill_(
            ~torch.cat([mask, torch.ones(batch, q_len, 1, dtype=torch.bool)], dim=-1), float("-inf"))
        slots = torch.cat([slots, torch.full((batch, 1), sink_slot, dtype=torch.int64)], dim=1)
        sink_column = torch.zeros(num_keys + 1)
        sink_column[-1] = 1.0
        return KVView(slots.to(device), additive[:, None].to(device, dtype), sink_column.to(device, dtype))

    swa_starts = [max(0, s - window + 1) for s in q_starts]
    return AttnGroup(None if rows is None else rows.to(device), batch, q_len, view(full_tables, [0] * batch, False),
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
        self.qk_width = (self.num_heads + self.num_kv_heads) * self.head_dim

    def fuse_qkv(self) -> None:
        """Make q/k/v_proj's weights (and biases) views of one [(H + Hkv) Dh + Hkv Dv, D] tensor, so the forward
        runs one GEMM; the parameters keep their names (state dicts and loading are unchanged)."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        names = ("weight", "bias") if self.q_proj.bias is not None else ("weight",)
        fused = {name: torch.cat([getattr(p, name).detach() for p in projections]) for name in names}
        for name, tensor in fused.items():
            offset = 0
            for p in projections:
                rows = getattr(p, name).shape[0]
                setattr(p, name, nn.Parameter(tensor[offset:offset + rows], requires_grad=False))
                offset += rows
        self._fused = (fused["weight"], fused.get("bias"))

    def _qkv(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fused projection's weight and bias; concatenated afresh if the parameters were replaced since
        `fuse_qkv` (e.g. a later `.to()`), so the forward stays right either way."""
        fused = getattr(self, "_fused", None)
        if fused is not None and fused[0].data_ptr() == self.q_proj.weight.data_ptr():
            return fused
        projections = (self.q_proj, self.k_proj, self.v_proj)
        bias = None if self.q_proj.bias is None else torch.cat([p.bias for p in projections])
        return torch.cat([p.weight for p in projections]), bias

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """x: [T, D]; cos/sin: [T, 1, rot]; k_cache: [num_slots, Hkv, Dh]; v_cache: [num_slots, Hkv, Dv] -> [T, D]."""
        num_tokens, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = F.linear(x, *self._qkv())  # [T, (H + Hkv) * Dh + Hkv * Dv]
        qk = apply_rotary(qkv[:, :self.qk_width].view(num_tokens, heads + kv_heads, self.head_dim), cos, sin)
        q, k = qk[:, :heads], qk[:, heads:]  # [T, H, Dh], [T, Hkv, Dh]
        v = qkv[:, self.qk_width:].view(num_tokens, kv_heads, self.v_head_dim)  # [T, Hkv, Dv]
        if self.v_scale != 1.0:
            v = v * self.v_scale
        write = meta.swa_write if self.is_swa else meta.full_write
        k_cache[write] = k.to(k_cache.dtype)
        v_cache[write] = v.to(v_cache.dtype)
        out = None
        for g in meta.groups:
            kv = g.swa if self.is_swa else g.full
            qg = q if g.rows is None else q[g.rows]
            qg = qg.view(g.batch, g.q_len, heads, self.head_dim).transpose(1, 2)  # [B, H, L, Dh]
            kg = k_cache[kv.slots].transpose(1, 2)  # [B, Hkv, S, Dh]
            vg = v_cache[kv.slots].transpose(1, 2)  # [B, Hkv, S, Dv]
            mask = kv.mask
            if self.sinks is not None:  # [B, H, L, S + 1]: the sink's score in its column (module NOTE)
                mask = mask + self.sinks.to(mask.dtype).view(1, heads, 1, 1) * kv.sink_column
            gqa = not qg.is_cuda
            if not gqa:  # NOTE: CUDA's memory-efficient kernel takes a mask but not enable_gqa: expand kv heads
                groups = heads // kv_heads
                kg, vg = kg.repeat_interleave(groups, dim=1), vg.repeat_interleave(groups, dim=1)  # [B, H, S, .]
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=self.scaling,
                                               enable_gqa=gqa)  # [B, H, L, Dv]
            o = o.transpose(1, 2).reshape(-1, heads * self.v_head_dim)  # [B * L, H * Dv]
            if g.rows is None:
                out = o
            else:
                if out is None:
                    out = torch.empty(num_tokens, heads * self.v_head_dim, dtype=x.dtype, device=x.device)
                out[g.rows] = o
        return self.o_proj(out)
