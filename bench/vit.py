"""`mmenc bench vit`: bare ViT forward, ours vs transformers' implementation, same weights, same run.

Packed batches of N square images (448px -> 1024 patches, 1008px -> 5184 patches each). Reports images/s
and TFLOP/s counted as 2 x parameters x patches, plus the max difference between the two outputs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from bench.common import environment, markdown_table, time_median, write_results
from encoder_server.config import VisionConfig
from encoder_server.models.loader import init_random
from encoder_server.models.vision import VisionTransformer


def _reference(cfg: VisionConfig, ours: VisionTransformer, attn: str) -> torch.nn.Module:
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    hf_cfg = Qwen2_5_VLVisionConfig(**cfg.to_hf_dict())
    hf_cfg._attn_implementation = attn
    ref = Qwen2_5_VisionTransformerPretrainedModel(hf_cfg)
    ref.load_state_dict(ours.state_dict())
    return ref.to(ours.merger.ln_q.weight.device, ours.merger.ln_q.weight.dtype).eval()


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mmenc bench vit", description=__doc__)
    p.add_argument("--preset", default="qwen2.5-vl-7b")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", default="448,1008", help="square image sides in pixels")
    p.add_argument("--batches", default="1,4,16,32", help="images per forward")
    p.add_argument("--ref-max-batch", type=int, default=32, help="largest batch also run on transformers")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile our blocks")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--name", default="vit")
    a = p.parse_args(argv)

    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    cfg = VisionConfig.preset(a.preset)
    torch.manual_seed(0)
    ours = VisionTransformer(cfg)
    init_random(ours, seed=0)
    ours = ours.to(device, dtype)
    ref = None if a.no_reference else _reference(cfg, ours, "sdpa")
    ours.prepare_for_inference()
    if a.compile:
        ours.compile_blocks()
    num_params = sum(p.numel() for p in ours.parameters())
    rows: list[dict[str, Any]] = []
    for size in _ints(a.sizes):
        side = size // cfg.patch_size
        for batch in _ints(a.batches):
            grids = [(1, side, side)] * batch
            num_patches = batch * side * side
            x = torch.randn(num_patches, cfg.patch_dim, device=device, dtype=dtype)
            flop = 2 * num_params * num_patches
            with torch.inference_mode():
                t_ours = time_median(lambda: ours(x, grids), device, a.warmup, a.iters)  # noqa: B023
                row: dict[str, Any] = {"size": size, "batch": batch, "patches": num_patches,
                                       "ours_img_s": batch / t_ours, "ours_tflops": flop / t_ours / 1e12}
                if ref is not None and batch <= a.ref_max_batch:
                    grid_t = torch.tensor(grids, device=device)
                    t_ref = time_median(lambda: ref(x, grid_t), device, 1, max(3, a.iters // 2))  # noqa: B023
                    expected = ref(x, grid_t).pooler_output.float()
                    got = ours(x, grids).float()
                    row.update(ref_img_s=batch / t_ref, ref_tflops=flop / t_ref / 1e12, speedup=t_ref / t_ours,
                               max_abs_diff=(got - expected).abs().max().item(),
                               ref_max_abs=expected.abs().max().item())
            rows.append(row)
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    payload = {"bench": "vit", "preset": a.preset, "dtype": a.dtype, "params": num_params, "compile": a.compile,
               "env": environment(device), "argv": argv if argv is not None else sys.argv[1:], "rows": rows}
    path = write_results(a.name, a.out_dir, payload)
    cols = ["size", "batch", "patches", "ours_img_s", "ours_tflops", "ref_img_s", "ref_tflops", "speedup",
            "max_abs_diff"]
    print(markdown_table(rows, cols))
    best = max(rows, key=lambda r: r["ours_tflops"])
    print(f"SUMMARY vit {a.preset} {a.dtype}: best {best['ours_tflops']:.0f} TFLOP/s ({best['ours_img_s']:.1f} img/s "
          f"at {best['size']}px x{best['batch']}); results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
