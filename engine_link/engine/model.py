"""MiMo-V2-Flash causal LM over the paged KV pools (state-dict names identical to transformers').

Layer pattern: full attention on layer 0 and every 6th layer, sliding-window attention (doubled kv heads,
attention sinks) elsewhere; dense MLP on layer 0, sparse MoE after.
"""

from __future__ import annotations

import torch
from torch import nn

from engine_link.engine.attention import Attention, AttnMetadata
from engine_link.engine.config import FULL, SWA, EngineModelConfig
from engine_link.engine.layers import DenseMLP, RMSNorm, RotaryEmbedding
from engine_link.engine.moe import MoE


class DecoderLayer(nn.Module):
    def __init__(self, cfg: EngineModelConfig, layer: int) -> None:
        super().__init__()
        self.kind = cfg.attn_types[layer]
        self.self_attn = Attention(cfg, layer)
        self.mlp = MoE(cfg) if cfg.mlp_types[layer] == "sparse" else DenseMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttnMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), *rope, meta, k_cache, v_cache)  # [T, D]
        return x + self.mlp(self.post_attention_layernorm(x))  # [T, D]


class MiMoV2FlashModel(nn.Module):
    def __init__(self, cfg: EngineModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)


class MiMoV2FlashForCausalLM(nn.Module):
    def __init__(self, cfg: EngineModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = MiMoV2FlashModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def prepare(self, device: torch.device, dtype: torch.dtype) -> MiMoV2FlashForCausalLM:
        """Move to `device`/`dtype`, keeping the routers in float32 (as transformers keeps them); fuse each layer's
        q/k/v projections into one GEMM; eval mode."""
        self.to(device=device, dtype=dtype)
        for module in self.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.float()
        self.model.rotary_emb.float()
        for layer in self.model.layers:
            layer.self_attn.fuse_qkv()
        return self.eval()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                kv: list[tuple[torch.Tensor, torch.Tensor]],
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Hidden states of a packed batch.

        Args:
            input_ids: [T] token ids (placeholders where `embeds` replaces the embedding).
            positions: [T] position of each token in its sequence.
            meta: attention groups and the slots the new K/V go to.
            kv: per layer (k_cache, v_cache) of that layer's pool.
            embeds: optional (rows [N], values [N, D]) replacing the token embedding of those packed rows.
        Returns:
            [T, D] final-norm hidden states.
        """
        x = self.model.embed_tokens(input_ids)  # [T, D]
        if embeds is not None:
            x[embeds[0]] = embeds[1].to(x.dtype)
        ropes = {kind: self.model.rotary_emb(positions, kind, x.dtype) for kind in (FULL, SWA)}
        for layer, (k_cache, v_cache) in zip(self.model.layers, kv, strict=True):
            x = layer(x, ropes[layer.kind], meta, k_cache, v_cache)
        return self.model.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [N, V]


def init_random(model: MiMoV2FlashForCausalLM, seed: int) -> None:
    """Deterministic random weights: N(0, initializer_range) for matrices, experts and the router; unit norms;
    zero biases; sinks and router correction bias N(0, 1) and N(0, 0.1) so they visibly matter in tests."""
    std = model.cfg.initializer_range
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("inv_freq"):
                continue
            if name.endswith("sinks"):
                value = torch.randn(p.shape, generator=gen)
            elif name.endswith("e_score_correction_bias"):
                value = torch.randn(p.shape, generator=gen) * 0.1
            elif name.endswith("norm.weight"):
                value = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif name.endswith(".bias"):
                value = torch.zeros(p.shape)
            else:
                value = torch.randn(p.shape, generator=gen) * std
            p.copy_(value.to(p.dtype))
