"""GPU checks of the ViT: the FlashAttention varlen path against the SDPA path and transformers (bf16)."""

from __future__ import annotations

import pytest
import torch

from encoder_server.config import VisionConfig
from encoder_server.models.loader import init_random
from encoder_server.models.vision import VisionTransformer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GRIDS = [(1, 32, 32), (1, 72, 72), (1, 30, 14), (1, 4, 4), (2, 12, 20)]


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


@torch.no_grad()
def test_flash_matches_sdpa_and_transformers_at_7b_shape() -> None:
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    torch.backends.cudnn.allow_tf32 = False  # transformers' Conv3d patch embedding would run in TF32
    cfg = VisionConfig.preset("qwen2.5-vl-7b")
    fp32 = VisionTransformer(cfg, attn_backend="sdpa")
    init_random(fp32, seed=0)
    hf_cfg = Qwen2_5_VLVisionConfig(**cfg.to_hf_dict())
    hf_cfg._attn_implementation = "sdpa"
    ref = Qwen2_5_VisionTransformerPretrainedModel(hf_cfg)
    ref.load_state_dict(fp32.state_dict())
    ref = ref.cuda().eval()
    flash = VisionTransformer(cfg, attn_backend="flash")
    flash.load_state_dict(fp32.state_dict())
    flash = flash.to("cuda", torch.bfloat16).prepare_for_inference()
    fp32 = fp32.cuda().prepare_for_inference()

    num_patches = sum(t * h * w for t, h, w in GRIDS)
    x = torch.randn(num_patches, cfg.patch_dim, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    exact = fp32(x, GRIDS)  # fp32, SDPA path
    expected = ref(x, torch.tensor(GRIDS, device="cuda")).pooler_output
    assert _relative_error(exact, expected) < 1e-4
    got = flash(x.bfloat16(), GRIDS)
    # bf16 through 32 blocks drifts from fp32 by a few percent of the output norm, for transformers too:
    # ours must drift no more than transformers' own bf16 run does (25% margin for rounding luck).
    ref_bf16 = ref.to(torch.bfloat16)(x.bfloat16(), torch.tensor(GRIDS, device="cuda")).pooler_output
    bf16_noise = _relative_error(ref_bf16, exact)
    assert _relative_error(got, exact) < 1.25 * bf16_noise
    # Each image alone equals its slice of the packed batch: exactly in fp32, within bf16 noise with flash
    # (a segment-boundary bug would show as an O(1) difference).
    out_offset = in_offset = 0
    for grid in GRIDS:
        n = grid[0] * grid[1] * grid[2]
        rows = slice(out_offset, out_offset + n // 4)
        assert _relative_error(fp32(x[in_offset:in_offset + n], [grid]), exact[rows]) < 1e-4
        assert _relative_error(flash(x[in_offset:in_offset + n].bfloat16(), [grid]), got[rows]) < 2 * bf16_noise
        in_offset, out_offset = in_offset + n, out_offset + n // 4
