"""Build the engine's model from a preset (random, seeded) or a transformers `save_pretrained` directory."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import torch

from encoder_server.models.loader import read_state_dict, resolve_device, resolve_dtype
from engine_link.engine.config import MODEL_PRESETS, EngineModelConfig
from engine_link.engine.model import MiMoV2FlashForCausalLM, init_random

__all__ = ["load_model", "load_tokenizer", "resolve_device", "resolve_dtype", "save_model"]

_IGNORED_PREFIXES = ("model.mtp.",)  # multi-token-prediction heads in the released checkpoint
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in read_state_dict(directory).items() if not k.startswith(_IGNORED_PREFIXES)}


def checkpoint_to_model_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint layout (what `save_pretrained` writes and the hub holds) -> our module layout.

    Per-expert `experts.{e}.{gate,up,down}_proj.weight` become fused `experts.gate_up_proj [E, 2I, D]`
    (gate rows first) and `experts.down_proj [E, D, I]`; `self_attn.attention_sink_bias` becomes
    `self_attn.sinks`. Names already in our layout pass through.
    """
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    for name, tensor in state.items():
        m = _EXPERT.match(name)
        if m:
            experts[m[1]][m[3]][int(m[2])] = tensor
        else:
            out[name.replace("self_attn.attention_sink_bias", "self_attn.sinks")] = tensor
    for prefix, parts in experts.items():
        num = 1 + max(max(p) for p in parts.values())
        if any(sorted(parts.get(k, {})) != list(range(num)) for k in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError(f"{prefix}: incomplete expert weights")
        stack = {k: torch.stack([parts[k][e] for e in range(num)]) for k in parts}  # [E, ., .]
        out[f"{prefix}.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)  # [E, 2I, D]
        out[f"{prefix}.down_proj"] = stack["down_proj"]  # [E, D, I]
    return out


def model_to_checkpoint_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `checkpoint_to_model_names`: per-expert weights and `attention_sink_bias`, as transformers saves."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            gate, up = tensor.chunk(2, dim=1)  # [E, I, D] each
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = gate[e].contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = up[e].contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e].contiguous()
        else:
            out[name.replace("self_attn.sinks", "self_attn.attention_sink_bias")] = tensor.contiguous()
    return out


def save_model(model: MiMoV2FlashForCausalLM, directory: str | Path) -> None:
    """Write config.json and model.safetensors in transformers' checkpoint layout (`from_pretrained` reads it)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.cfg.to_hf_dict(), indent=2))
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}  # clone: q/k/v share storage
    if model.cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(model_to_checkpoint_names(state), str(directory / "model.safetensors"), metadata={"format": "pt"})


def load_state(model: MiMoV2FlashForCausalLM, state: dict[str, torch.Tensor], source: str) -> None:
    """Strict load: a missing, unexpected or mis-shaped tensor is a ValueError naming it."""
    if model.cfg.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    expected = model.state_dict()
    if model.cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(state) & set(expected) if state[k].shape != expected[k].shape)
    if missing or unexpected or wrong:
        shapes = [f"{k}: {tuple(state[k].shape)} != {tuple(expected[k].shape)}" for k in wrong[:5]]
        raise ValueError(f"{source}: weights do not match the config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}, wrong shape {shapes}")
    with torch.no_grad():
        for name, tensor in expected.items():
            tensor.copy_(state[name])


def load_model(spec: str, device: torch.device, dtype: torch.dtype) -> MiMoV2FlashForCausalLM:
    """`spec`: a preset name (MODEL_PRESETS) or a directory with config.json and *.safetensors.

    Raises:
        ValueError: unknown preset, unreadable directory, or weights that do not fit the config.
    """
    if spec in MODEL_PRESETS:
        cfg = MODEL_PRESETS[spec]
        with torch.device("cpu"):
            model = MiMoV2FlashForCausalLM(cfg)
        init_random(model, cfg.seed)
    else:
        directory = Path(spec)
        config_path = directory / "config.json"
        if not config_path.is_file():
            raise ValueError(f"{spec!r} is neither a preset {sorted(MODEL_PRESETS)} nor a directory with config.json")
        cfg = EngineModelConfig.from_hf_dict(json.loads(config_path.read_text()))
        model = MiMoV2FlashForCausalLM(cfg)
        load_state(model, checkpoint_to_model_names(read_safetensors(directory)), str(directory))
    return model.prepare(device, dtype)


def load_tokenizer(spec: str):  # noqa: ANN201 - a `tokenizers.Tokenizer` or None
    """The directory's tokenizer.json as a `tokenizers.Tokenizer`, or None (presets, or no tokenizer file)."""
    path = Path(spec) / "tokenizer.json"
    if spec in MODEL_PRESETS or not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_file(str(path))
