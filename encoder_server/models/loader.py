"""Build the vision encoder from a preset (random, seeded) or a local transformers-layout directory."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from encoder_server.config import VISION_PRESETS, VisionConfig
from encoder_server.models.vision import VisionTransformer

# Prefixes under which the vision tower's weights appear in transformers checkpoints.
_PREFIXES = ("model.visual.", "visual.", "")


@dataclass(frozen=True)
class LoadedVision:
    model: VisionTransformer
    cfg: VisionConfig
    fingerprint: str  # architecture + weights identity (for cache keys)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def init_random(model: VisionTransformer, seed: int) -> None:
    """Deterministic random weights: N(0, 0.02) for matrices, zero biases, unit norms."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


def read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the `*.safetensors` files in `directory` (ValueError when there are none)."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory}: no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], directory: Path) -> None:
    """Load `weights` strictly; any missing, unexpected or mis-shaped tensor is a ValueError naming it."""
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise ValueError(f"{directory}: weights do not match the config: {e}") from e
    if missing or unexpected:
        raise ValueError(f"{directory}: weights do not match the config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")


def weights_fingerprint(cfg: object, weights: dict[str, torch.Tensor]) -> str:
    """Identity of a model: its config and every weight's name, dtype, shape and bytes (for cache keys)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr(cfg).encode())
    for name in sorted(weights):
        tensor = weights[name].contiguous()
        digest.update(f"{name}{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _vision_weights(state: dict[str, torch.Tensor], directory: Path) -> dict[str, torch.Tensor]:
    for prefix in _PREFIXES:
        key = prefix + "patch_embed.proj.weight"
        if key in state:
            return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    raise ValueError(f"{directory}: no vision tower weights (looked for *patch_embed.proj.weight)")


def load_vision(spec: str, device: torch.device, dtype: torch.dtype, attn_backend: str = "auto") -> LoadedVision:
    """Load `spec`: a preset name from VISION_PRESETS, or a directory with config.json + safetensors.

    Raises:
        ValueError: unknown preset, unreadable directory, or weights that do not fit the config.
    """
    if spec in VISION_PRESETS:
        cfg = VISION_PRESETS[spec]
        model = VisionTransformer(cfg, attn_backend)
        init_random(model, cfg.seed)
        fingerprint = hashlib.blake2b(f"preset:{spec}:{cfg!r}".encode(), digest_size=16).hexdigest()
    else:
        directory = Path(spec)
        config_path = directory / "config.json"
        if not config_path.is_file():
            raise ValueError(f"{spec!r} is neither a preset {sorted(VISION_PRESETS)} nor a directory with config.json")
        cfg = VisionConfig.from_hf_dict(json.loads(config_path.read_text()))
        model = VisionTransformer(cfg, attn_backend)
        weights = _vision_weights(read_state_dict(directory), directory)
        load_weights(model, weights, directory)
        fingerprint = weights_fingerprint(cfg, weights)
    model = model.to(device=device, dtype=dtype).prepare_for_inference()
    return LoadedVision(model, cfg, fingerprint)
