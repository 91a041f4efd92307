"""Frozen engine configuration: the model's shape (`EngineModelConfig`, the MiMo-V2-Flash fields we use) and
the serving knobs (`EngineConfig`: KV pools, batch limits, waiting-queue policy, device).

`EngineModelConfig.to_hf_dict()` / `from_hf_dict()` round-trip through transformers' `MiMoV2FlashConfig`
dict, so a `save_pretrained` directory describes our model and ours describes transformers'.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

FULL = "full_attention"
SWA = "sliding_attention"
POLICIES = ("fewest-uncached", "fcfs")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _unless_default(values: list[str] | None, default: tuple[str, ...]) -> tuple[str, ...] | None:
    """None when `values` is the default pattern, so configs compare equal however they were written."""
    return None if not values or tuple(values) == default else tuple(values)


def default_layer_types(num_layers: int) -> tuple[str, ...]:
    """Full attention on layer 0 and every 6th layer (5, 11, ...), sliding window elsewhere (transformers' default)."""
    return tuple(FULL if (i == 0 or (i + 1) % 6 == 0) else SWA for i in range(num_layers))


@dataclass(frozen=True)
class EngineModelConfig:
    """Shape of a MiMo-V2-Flash model (field names follow `MiMoV2FlashConfig`)."""

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128  # dense MLP (layer 0)
    moe_intermediate_size: int = 32
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 1  # full-attention layers; SWA layers have twice as many
    head_dim: int = 32  # q/k
    v_head_dim: int = 16
    sliding_window: int = 8  # keys attended by a SWA query, the query included
    layer_types: tuple[str, ...] | None = None  # None: default_layer_types (read `attn_types`)
    mlp_layer_types: tuple[str, ...] | None = None  # None: dense first layer, sparse (MoE) after (`mlp_types`)
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_group: int = 4
    topk_group: int = 2
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    rope_theta_full: float = 5_000_000.0
    rope_theta_swa: float = 10_000.0
    partial_rotary_factor_full: float = 0.334
    partial_rotary_factor_swa: float = 0.334
    attention_value_scale: float = 0.707
    attention_bias: bool = False
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 131072
    bos_token_id: int | None = 1
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    initializer_range: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        sizes = (self.vocab_size, self.hidden_size, self.num_hidden_layers, self.num_attention_heads,
                 self.num_key_value_heads, self.head_dim, self.v_head_dim, self.sliding_window)
        _require(all(s > 0 for s in sizes), "model sizes must be > 0")
        _require(len(self.attn_types) == self.num_hidden_layers, "layer_types needs one entry per layer")
        _require(set(self.attn_types) <= {FULL, SWA}, f"layer_types must be {FULL!r} or {SWA!r}")
        _require(len(self.mlp_types) == self.num_hidden_layers, "mlp_layer_types needs one entry per layer")
        _require(set(self.mlp_types) <= {"dense", "sparse"}, "mlp_layer_types must be 'dense' or 'sparse'")
        _require(self.num_attention_heads % (2 * self.num_key_value_heads) == 0,
                 "num_attention_heads must be divisible by 2 * num_key_value_heads (SWA layers double kv heads)")
        if "sparse" in self.mlp_types:
            _require(self.n_routed_experts % self.n_group == 0, "n_routed_experts must be divisible by n_group")
            _require(self.n_routed_experts // self.n_group >= 2, "each expert group needs >= 2 experts")
            _require(0 < self.topk_group <= self.n_group, "need 0 < topk_group <= n_group")
            _require(0 < self.num_experts_per_tok <= self.topk_group * self.n_routed_experts // self.n_group,
                     "num_experts_per_tok must fit in the selected groups")
        _require(self.hidden_act == "silu", f"unsupported hidden_act {self.hidden_act!r}")
        for factor in (self.partial_rotary_factor_full, self.partial_rotary_factor_swa):
            _require(0 < factor <= 1 and self.rotary_dim(factor) <= self.head_dim, "bad partial_rotary_factor")

    # ---- derived ----
    @property
    def attn_types(self) -> tuple[str, ...]:
        """Attention kind per layer (FULL or SWA)."""
        return tuple(self.layer_types) if self.layer_types else default_layer_types(self.num_hidden_layers)

    @property
    def mlp_types(self) -> tuple[str, ...]:
        """MLP kind per layer ("dense" or "sparse")."""
        if self.mlp_layer_types:
            return tuple(self.mlp_layer_types)
        return ("dense",) + ("sparse",) * (self.num_hidden_layers - 1)

    @staticmethod
    def rotary_dim_of(head_dim: int, factor: float) -> int:
        """Rotated channels, as transformers computes them: 2 * len(arange(0, int(head_dim * factor), 2))."""
        dim = int(head_dim * factor)
        return 2 * ((dim + 1) // 2)

    def rotary_dim(self, factor: float) -> int:
        return self.rotary_dim_of(self.head_dim, factor)

    def is_swa(self, layer: int) -> bool:
        return self.attn_types[layer] == SWA

    def num_kv_heads(self, layer: int) -> int:
        return self.num_key_value_heads * (2 if self.is_swa(layer) else 1)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.attn_types) if t == FULL)

    @property
    def swa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.attn_types) if t == SWA)

    def kv_elems_per_token(self, layer: int) -> int:
        """K and V elements one token stores in one layer."""
        return self.num_kv_heads(layer) * (self.head_dim + self.v_head_dim)

    def kv_bytes(self, context: int, dtype_bytes: int = 2, all_full: bool = False) -> int:
        """KV bytes one request of `context` tokens holds: full layers O(context), SWA layers O(window).

        With `all_full`, the same model with every layer full attention (and the SWA layers' kv heads).
        """
        total = 0
        for layer in range(self.num_hidden_layers):
            tokens = context if (all_full or not self.is_swa(layer)) else min(context, self.sliding_window)
            total += tokens * self.kv_elems_per_token(layer)
        return total * dtype_bytes

    # ---- transformers dict ----
    def to_hf_dict(self) -> dict[str, Any]:
        """Keyword arguments for transformers' `MiMoV2FlashConfig` (and the content of config.json)."""
        return {
            "model_type": "mimo_v2_flash", "architectures": ["MiMoV2FlashForCausalLM"],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim, "v_head_dim": self.v_head_dim,
            "sliding_window": self.sliding_window, "layer_types": list(self.attn_types),
            "mlp_layer_types": list(self.mlp_types), "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok, "n_group": self.n_group, "topk_group": self.topk_group,
            "norm_topk_prob": self.norm_topk_prob, "routed_scaling_factor": self.routed_scaling_factor,
            "rope_parameters": {
                FULL: {"rope_type": "default", "rope_theta": self.rope_theta_full,
                       "partial_rotary_factor": self.partial_rotary_factor_full},
                SWA: {"rope_type": "default", "rope_theta": self.rope_theta_swa,
                      "partial_rotary_factor": self.partial_rotary_factor_swa},
            },
            "attention_value_scale": self.attention_value_scale, "attention_bias": self.attention_bias,
            "rms_norm_eps": self.rms_norm_eps, "hidden_act": self.hidden_act,
            "tie_word_embeddings": self.tie_word_embeddings, "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id, "pad_token_id": self.pad_token_id,
            "eos_token_id": (None if not self.eos_token_id else
                             self.eos_token_id[0] if len(self.eos_token_id) == 1 else list(self.eos_token_id)),
            "initializer_range": self.initializer_range,
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> EngineModelConfig:
        """Read a transformers MiMo-V2-Flash config dict (config.json).

        Raises:
            ValueError: a rope type other than "default", or a shape the validation rejects.
        """
        num_layers = int(d["num_hidden_layers"])
        rope = d.get("rope_parameters") or {}
        for kind in (FULL, SWA):
            rope_type = (rope.get(kind) or {}).get("rope_type", "default")
            _require(rope_type == "default", f"unsupported rope_type {rope_type!r} for {kind}")
        window = d.get("sliding_window", 129)
        if d.get("sliding_window_size") is not None:  # SGLang's convention: previous tokens, without the query
            window = int(d["sliding_window_size"]) + 1
        eos = d.get("eos_token_id")
        eos = () if eos is None else (tuple(eos) if isinstance(eos, list | tuple) else (int(eos),))
        scale = d.get("attention_value_scale", 0.707)
        return cls(
            vocab_size=d.get("vocab_size", 152576), hidden_size=d.get("hidden_size", 4096),
            intermediate_size=d.get("intermediate_size", 16384),
            moe_intermediate_size=d.get("moe_intermediate_size", 2048), num_hidden_layers=num_layers,
            num_attention_heads=d.get("num_attention_heads", 64), num_key_value_heads=d.get("num_key_value_heads", 4),
            head_dim=d.get("head_dim", 192), v_head_dim=d.get("v_head_dim", 128), sliding_window=window,
            layer_types=_unless_default(d.get("layer_types"), default_layer_types(num_layers)),
            mlp_layer_types=_unless_default(d.get("mlp_layer_types"), ("dense",) + ("sparse",) * (num_layers - 1)),
            n_routed_experts=d.get("n_routed_experts", d.get("num_local_experts", 256)),
            num_experts_per_tok=d.get("num_experts_per_tok", 8), n_group=d.get("n_group", 1),
            topk_group=d.get("topk_group", 1), norm_topk_prob=d.get("norm_topk_prob", True),
            routed_scaling_factor=d.get("routed_scaling_factor") or 1.0,
            rope_theta_full=(rope.get(FULL) or {}).get("rope_theta", 5_000_000.0),
            rope_theta_swa=(rope.get(SWA) or {}).get("rope_theta", 10_000.0),
            partial_rotary_factor_full=(rope.get(FULL) or {}).get("partial_rotary_factor", 0.334),
            partial_rotary_factor_swa=(rope.get(SWA) or {}).get("partial_rotary_factor", 0.334),
            attention_value_scale=1.0 if scale is None else float(scale),
            attention_bias=d.get("attention_bias", False), rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            hidden_act=d.get("hidden_act", "silu"), tie_word_embeddings=d.get("tie_word_embeddings", False),
            max_position_embeddings=d.get("max_position_embeddings", 131072), bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos, pad_token_id=d.get("pad_token_id"),
            initializer_range=d.get("initializer_range", 0.02),
        )


MODEL_PRESETS: dict[str, EngineModelConfig] = {
    # CPU tests: 8 layers (full 0 and 5), window 8 so a test crosses it in a few tokens.
    "tiny": EngineModelConfig(),
    # H200 benchmarks: ~3.1B parameters (~1.1B active), bf16; the real model's head dims, window and layer mix.
    "mid": EngineModelConfig(
        vocab_size=32768, hidden_size=2048, intermediate_size=8192, moe_intermediate_size=512,
        num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4, head_dim=192, v_head_dim=128,
        sliding_window=128, n_routed_experts=32, num_experts_per_tok=4, n_group=1, topk_group=1,
        routed_scaling_factor=1.0, initializer_range=0.02, eos_token_id=()),
}


@dataclass(frozen=True)
class EngineConfig:
    """Serving knobs: KV pool sizes (token slots), batch limits, waiting-queue policy, device.

    A request needs one full-pool slot per token of its sequence and about `window + chunk` SWA slots.
    """

    num_full_slots: int = 4096
    num_swa_slots: int = 0  # 0: room for max_num_seqs requests at full window plus one chunk (`swa_slots_for`)
    max_num_seqs: int = 64
    max_prefill_tokens: int = 512  # prefill tokens per step (chunk budget); decodes come on top
    swa_release_interval: int = 4  # decode steps between releases of out-of-window SWA slots
    enable_prefix_cache: bool = True
    policy: str = "fewest-uncached"
    penalty_tokens_per_s: float = 1000.0
    device: str = "auto"
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    seed: int = 0

    def __post_init__(self) -> None:
        _require(self.num_full_slots > 0 and self.num_swa_slots >= 0, "KV pools need > 0 slots")
        _require(self.max_num_seqs > 0, "max_num_seqs must be > 0")
        _require(self.max_prefill_tokens > 0, "max_prefill_tokens must be > 0")
        _require(self.swa_release_interval > 0, "swa_release_interval must be > 0")
        _require(self.policy in POLICIES, f"unknown policy {self.policy!r}; choices: {', '.join(POLICIES)}")
        _require(self.penalty_tokens_per_s >= 0, "penalty_tokens_per_s must be >= 0")
        _require(self.dtype in ("auto", "float32", "bfloat16", "float16"), f"unknown dtype {self.dtype!r}")

    def swa_slots_for(self, model: EngineModelConfig) -> int:
        """SWA pool size: `num_swa_slots`, or (0) what max_num_seqs decoding requests plus one chunk hold at most:
        each keeps window - 1 positions and gains up to swa_release_interval + 1 before a release."""
        if self.num_swa_slots:
            return self.num_swa_slots
        per_request = model.sliding_window + self.swa_release_interval + 1
        return self.max_num_seqs * per_request + self.max_prefill_tokens + model.sliding_window

    def check_model(self, model: EngineModelConfig) -> None:
        """The SWA pool must hold one request's window plus a chunk and a release interval, or nothing runs."""
        need = model.sliding_window + self.max_prefill_tokens + self.swa_release_interval
        _require(self.swa_slots_for(model) >= need, f"num_swa_slots={self.num_swa_slots} is below "
                 f"sliding_window + max_prefill_tokens + swa_release_interval = {need}")

    def with_overrides(self, **overrides: Any) -> EngineConfig:
        unknown = set(overrides) - set(self.__dataclass_fields__)
        _require(not unknown, f"unknown engine options {sorted(unknown)}")
        return replace(self, **overrides)
