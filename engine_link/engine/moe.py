"""Sparse MoE of MiMo-V2-Flash: sigmoid top-k router with group-limited selection, routed experts, no shared
expert. Weight names and layout follow transformers (`mlp.gate.weight`, `mlp.gate.e_score_correction_bias`,
`mlp.experts.gate_up_proj [E, 2I, D]`, `mlp.experts.down_proj [E, D, I]`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine_link.engine.config import EngineModelConfig

log = logging.getLogger(__name__)


class TopkRouter(nn.Module):
    """Scores = sigmoid(x W^T); choice = scores + correction bias, restricted to the `topk_group` best groups
    (a group's score is the sum of its two best experts); weights = the chosen experts' raw scores,
    optionally normalized, times `routed_scaling_factor`. Kept in float32 (as the checkpoint stores it).
    """

    def __init__(self, cfg: EngineModelConfig) -> None:
        super().__init__()
        self.top_k, self.num_experts = cfg.num_experts_per_tok, cfg.n_routed_experts
        self.num_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] -> (weights [T, k] float32, expert ids [T, k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias  # [T, E]
        if self.topk_group < self.num_group:
            choice = self._best_groups_only(choice)
        topk_idx = choice.topk(self.top_k, dim=-1, sorted=False)[1]  # [T, k]
        weights = scores.gather(1, topk_idx)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, topk_idx

    def _best_groups_only(self, choice: torch.Tensor) -> torch.Tensor:
        """choice [T, E] with the experts outside each token's `topk_group` best groups set to -inf."""
        grouped = choice.view(-1, self.num_group, self.num_experts // self.num_group)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]  # [T, kg]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()  # [T, G]
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(-1, self.num_experts)  # [T, E]
        return choice.masked_fill(~expert_mask, float("-inf"))


class Experts(nn.Module):
    """Routed experts. Assignments (token, expert) are sorted by expert and run as two grouped GEMMs
    (`torch._grouped_mm`, offsets on the device): a fixed dozen ops per layer whatever the batch, and no
    device-to-host sync, where a loop over active experts costs ~8 ops per expert and a `.tolist()` sync.
    Falls back to that loop where this torch has no grouped GEMM for the device / dtype / shapes.
    """

    def __init__(self, cfg: EngineModelConfig) -> None:
        super().__init__()
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))
        self.grouped: dict[tuple[str, torch.dtype], bool] = {}  # (device type, dtype) -> grouped GEMM works

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x: [T, D]; topk_idx/topk_weights: [T, k] -> [T, D]."""
        where = (x.device.type, x.dtype)
        if self.grouped.get(where) is not False and hasattr(torch, "_grouped_mm"):
            try:
                out = self._grouped(x, topk_idx, topk_weights)
                self.grouped[where] = True
                return out
            except RuntimeError as e:
                if self.grouped.get(where):  # worked before here: a real failure, not a missing kernel
                    raise
                log.info("grouped expert GEMM unavailable on %s %s (%s); looping over experts",
                         x.device.type, x.dtype, str(e).splitlines()[0][:200])
                self.grouped[where] = False
        return self._loop(x, topk_idx, topk_weights)

    def _grouped(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        num_tokens, k = topk_idx.shape
        flat_idx = topk_idx.reshape(-1)  # [T * k]
        order = flat_idx.argsort(stable=True)  # assignments grouped by expert
        ends = torch.bincount(flat_idx, minlength=self.gate_up_proj.shape[0]).cumsum(0).to(torch.int32)  # [E]
        xs = x[order // k]  # [T * k, D]
        gate, up = torch._grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs=ends).chunk(2, dim=-1)  # [T*k, I]
        h = torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=ends)  # [T * k, D]
        weighted = torch.empty(num_tokens * k, x.shape[1], dtype=torch.float32, device=x.device)
        weighted[order] = h.float() * topk_weights.reshape(-1)[order, None]  # back to (token, slot) order
        return weighted.view(num_tokens, k, -1).sum(dim=1).to(x.dtype)

    def _loop(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """One gathered GEMM pair per active expert.

        NOTE: index_put_(accumulate) rather than index_add_, which takes ~50 ms per call on CPU in this torch.
        """
        out = torch.zeros_like(x)
        flat_idx = topk_idx.reshape(-1)  # [T * k]
        order = flat_idx.argsort(stable=True)
        counts = torch.bincount(flat_idx, minlength=self.gate_up_proj.shape[0]).tolist()
        token_of = order // topk_idx.shape[1]  # [T * k] token of each sorted assignment
        weight_of = topk_weights.reshape(-1)[order]  # [T * k]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of[start:start + count]  # [n]
            gate, up = F.linear(x[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)  # [n, I] each
            h = F.linear(F.silu(gate) * up, self.down_proj[expert])  # [n, D]
            h = h * weight_of[start:start + count, None]
            out.index_put_((tokens,), h.to(out.dtype), accumulate=True)
            start += count
        return out


class MoE(nn.Module):
    def __init__(self, cfg: EngineModelConfig) -> None:
        super().__init__()
        self.experts = Experts(cfg)
        self.gate = TopkRouter(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, idx = self.gate(x)
        return self.experts(x, idx, weights)
