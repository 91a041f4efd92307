"""Qwen2.5-VL vision transformer for packed variable-length batches.

Parameter names equal transformers' `Qwen2_5_VisionTransformerPretrainedModel`, so the `visual.*`
weights of a Qwen2.5-VL checkpoint load unchanged. The forward differs in how it runs, not in what it
computes: the host-side layout (window permutation, rotary positions, segments) is cached per grid,
the Conv3d patch embedding is one GEMM, gate and up projections share one GEMM, attention runs
through a varlen kernel (FlashAttention on CUDA, grouped SDPA elsewhere), and nothing is padded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from encoder_server.config import VisionConfig
from encoder_server.models.attention import Segments, get_backend, select_backend
from encoder_server.models.vision_layout import Grid, PackedLayout, build_layout

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class PatchEmbed(nn.Module):
    """Conv3d with kernel == stride == patch, i.e. one GEMM over flattened patches."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel, stride=kernel, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight.view(self.proj.weight.shape[0], -1)  # [E, C*tp*p*p]
        return F.linear(patches.to(weight.dtype), weight)  # [T, E]


class VisionRotary(nn.Module):
    """Axial 2-D rotary: half of each head's rotary frequencies follow the row, half the column."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        spatial_dim = head_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, spatial_dim, 2, dtype=torch.float) / spatial_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D/4]

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [T, 2, D/4]
        freqs = freqs.flatten(1)  # [T, D/2]: rows then cols
        return freqs.cos()[:, None, :], freqs.sin()[:, None, :]  # [T, 1, D/2] each


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, 1, D/2] (both halves share them). Computed in float32."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, seg: Segments, rotary: tuple[torch.Tensor, torch.Tensor],
                attn_backend: str) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv(x).view(num_tokens, 3, self.num_heads, self.head_dim).unbind(1)  # [T, H, D] x3
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        out = get_backend(attn_backend)(q, k, v.contiguous(), seg, self.scale)  # [T, H, D]
        return self.proj(out.reshape(num_tokens, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.gate_up_weight: torch.Tensor | None = None
        self.gate_up_bias: torch.Tensor | None = None

    def fuse_gate_up(self) -> None:
        """Put gate and up weights in one buffer (one GEMM); the parameters become views into it.

        NOTE: call after the final `.to(device, dtype)`: a later conversion copies the parameters and
        unties them from the fused buffer (`forward` then falls back to two GEMMs).
        """
        self.gate_up_weight = torch.cat([self.gate_proj.weight.data, self.up_proj.weight.data])  # [2I, E]
        self.gate_up_bias = torch.cat([self.gate_proj.bias.data, self.up_proj.bias.data])  # [2I]
        inter = self.gate_proj.weight.shape[0]
        self.gate_proj.weight.data, self.up_proj.weight.data = self.gate_up_weight.split(inter)
        self.gate_proj.bias.data, self.up_proj.bias.data = self.gate_up_bias.split(inter)

    def _is_fused(self) -> bool:
        w = self.gate_up_weight
        return w is not None and self.gate_proj.weight.data_ptr() == w.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._is_fused():
            gate, up = F.linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)  # [T, I] x2
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size)
        self.norm2 = RMSNorm(cfg.hidden_size)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, seg: Segments, rotary: tuple[torch.Tensor, torch.Tensor],
                attn_backend: str) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), seg, rotary, attn_backend)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm, then each 2x2 group of patches (adjacent in the sequence) -> MLP -> one output token."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.merged_dim = cfg.hidden_size * cfg.merge_unit
        self.ln_q = RMSNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_dim, self.merged_dim), nn.GELU(), nn.Linear(self.merged_dim, cfg.out_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))  # [T / unit, out]


class VisionTransformer(nn.Module):
    """Qwen2.5-VL ViT. `forward(pixel_values [T, patch_dim], grids) -> [T / merge_unit, out_hidden_size]`."""

    def __init__(self, cfg: VisionConfig, attn_backend: str = "auto") -> None:
        super().__init__()
        self.cfg = cfg
        self.attn_backend_name = attn_backend
        self.patch_embed = PatchEmbed(cfg)
        self.rotary_pos_emb = VisionRotary(cfg.head_dim, cfg.rope_theta)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        self._full_blocks = frozenset(cfg.fullatt_block_indexes)

    @property
    def window_units(self) -> int:
        return self.cfg.window_size // self.cfg.spatial_merge_size // self.cfg.patch_size

    def prepare_for_inference(self) -> VisionTransformer:
        """Eval mode and fused gate/up GEMMs. Call after moving to the final device and dtype."""
        self.eval().requires_grad_(False)
        for block in self.blocks:
            block.mlp.fuse_gate_up()
        return self

    def compile_blocks(self) -> VisionTransformer:
        """torch.compile each block (fuses norms, rotary, activation and residual adds around the GEMMs)."""
        for i, block in enumerate(self.blocks):
            self.blocks[i] = torch.compile(block, dynamic=True)
        return self

    def layout(self, grids: Sequence[Grid]) -> PackedLayout:
        device, dtype = self.merger.ln_q.weight.device, self.merger.ln_q.weight.dtype
        backend = select_backend(self.attn_backend_name, device, dtype)
        return build_layout([tuple(g) for g in grids], self.cfg.spatial_merge_size, self.window_units, device,
                            with_groups=backend == "sdpa")

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid] | torch.Tensor,
                layout: PackedLayout | None = None) -> torch.Tensor:
        """Encode a packed batch.

        Args:
            pixel_values: [T, C*tp*p*p] patches of all items, each item in patchify (merge-block) order.
            grids: one (t, h, w) per item, in patches; sum of t*h*w == T.
            layout: precomputed `self.layout(grids)` (optional; lets a caller build it ahead of time).
        Returns:
            [T / merge_unit, out_hidden_size] embeddings, items in input order.
        """
        if isinstance(grids, torch.Tensor):
            grids = [tuple(int(x) for x in g) for g in grids.tolist()]
        device, dtype = self.merger.ln_q.weight.device, self.merger.ln_q.weight.dtype
        backend = select_backend(self.attn_backend_name, device, dtype)
        layout = layout or self.layout(grids)
        x = self.patch_embed(pixel_values.to(device, non_blocking=True))  # [T, E] patchify order
        x = x.index_select(0, layout.token_order)  # [T, E] window order
        rotary = self.rotary_pos_emb(layout.positions)  # ([T, 1, D/2], [T, 1, D/2])
        for i, block in enumerate(self.blocks):
            seg = layout.full if i in self._full_blocks else layout.windowed
            x = block(x, seg, rotary, backend)
        return self.merger(x).index_select(0, layout.output_order)  # [T / unit, out] patchify order
