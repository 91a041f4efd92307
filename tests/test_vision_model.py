"""Our ViT against transformers' Qwen2_5_VisionTransformerPretrainedModel on the same weights (fp32, CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

from encoder_server.config import VisionConfig
from encoder_server.models.loader import init_random, load_vision
from encoder_server.models.vision import VisionTransformer

# fp32 on CPU: both compute the same math in a different order (fused GEMMs, grouped attention).
ATOL = 1e-5
# Several sizes: windows cut at the edges (30x14), a grid smaller than one window, a two-frame grid.
GRIDS = [(1, 16, 24), (1, 8, 8), (1, 30, 14), (1, 4, 4), (2, 12, 20), (1, 2, 40)]


def _reference(cfg: VisionConfig, state: dict[str, torch.Tensor]) -> Qwen2_5_VisionTransformerPretrainedModel:
    hf_cfg = Qwen2_5_VLVisionConfig(**cfg.to_hf_dict())
    hf_cfg._attn_implementation = "sdpa"
    ref = Qwen2_5_VisionTransformerPretrainedModel(hf_cfg).eval()
    ref.load_state_dict(state)
    return ref


@pytest.fixture(scope="module")
def models() -> tuple[VisionTransformer, Qwen2_5_VisionTransformerPretrainedModel]:
    # Larger weights than the default init so that every block changes the output noticeably.
    cfg = VisionConfig()
    ours = VisionTransformer(cfg)
    init_random(ours, seed=3)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if p.dim() > 1:
                p.mul_(5.0)
            elif name.endswith(".bias"):
                p.normal_(0, 0.05)
    ref = _reference(cfg, ours.state_dict())
    return ours.prepare_for_inference(), ref


def _patches(grids: list[tuple[int, int, int]], seed: int = 0) -> torch.Tensor:
    num_tokens = sum(t * h * w for t, h, w in grids)
    return torch.randn(num_tokens, VisionConfig().patch_dim, generator=torch.Generator().manual_seed(seed))


def test_state_dict_names_match_transformers(models) -> None:
    ours, ref = models
    assert set(ours.state_dict()) == set(ref.state_dict())


@torch.no_grad()
def test_packed_batch_matches_transformers(models) -> None:
    ours, ref = models
    x = _patches(GRIDS)
    expected = ref(x, torch.tensor(GRIDS)).pooler_output
    got = ours(x, GRIDS)
    assert got.shape == expected.shape == (x.shape[0] // 4, VisionConfig().out_hidden_size)
    assert expected.abs().max() > 0.1  # the comparison is not between two near-zero tensors
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-4)


@torch.no_grad()
def test_each_item_same_packed_or_alone(models) -> None:
    ours, _ = models
    x = _patches(GRIDS, seed=1)
    packed = ours(x, GRIDS)
    in_offset = out_offset = 0
    for grid in GRIDS:
        n = grid[0] * grid[1] * grid[2]
        alone = ours(x[in_offset:in_offset + n], [grid])
        torch.testing.assert_close(packed[out_offset:out_offset + n // 4], alone, atol=ATOL, rtol=1e-4)
        in_offset, out_offset = in_offset + n, out_offset + n // 4


@torch.no_grad()
def test_load_from_save_pretrained_directory(tmp_path, models) -> None:
    _, ref = models
    ref.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["depth"] == VisionConfig().depth
    loaded = load_vision(str(tmp_path), torch.device("cpu"), torch.float32)
    x = _patches(GRIDS[:3], seed=2)
    torch.testing.assert_close(loaded.model(x, GRIDS[:3]), ref(x, torch.tensor(GRIDS[:3])).pooler_output,
                               atol=ATOL, rtol=1e-4)
    assert loaded.fingerprint != load_vision("tiny", torch.device("cpu"), torch.float32).fingerprint


def test_load_rejects_mismatched_weights(tmp_path, models) -> None:
    _, ref = models
    ref.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["depth"] = config["depth"] + 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="missing"):
        load_vision(str(tmp_path), torch.device("cpu"), torch.float32)


def test_load_rejects_unknown_spec(tmp_path) -> None:
    with pytest.raises(ValueError, match="neither a preset"):
        load_vision(str(tmp_path / "nope"), torch.device("cpu"), torch.float32)


def test_presets_have_the_published_shapes() -> None:
    big = VisionConfig.preset("qwen2.5-vl-7b")
    assert (big.depth, big.hidden_size, big.num_heads, big.intermediate_size, big.out_hidden_size) == (
        32, 1280, 16, 3420, 3584)
    assert big.fullatt_block_indexes == (7, 15, 23, 31) and big.window_size == 112
    with torch.device("meta"):
        num_params = sum(p.numel() for p in VisionTransformer(big).parameters())
    assert abs(num_params - 676.6e6) < 0.1e6


def test_load_rejects_weights_of_another_shape(tmp_path, models) -> None:
    _, ref = models
    ref.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = config["intermediate_size"] * 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="do not match the config"):
        load_vision(str(tmp_path), torch.device("cpu"), torch.float32)
