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


def _mix_ceiling(model: VisionTransformer, a: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                 num_params: int) -> dict[str, Any]:
    """Forwards packed as the server packs them, from images drawn from `a.mix`: images/s at 100% busy."""
    import random

    from bench.media import ImageMix
    from encoder_server.config import PreprocessConfig
    from preprocess.image import target_size

    mix, prep = ImageMix.parse(a.mix), PreprocessConfig()
    rng = random.Random(0)
    grids = []
    for _ in range(512):
        width, height = rng.choices(mix.sizes, weights=mix.weights)[0]
        h, w = target_size(height, width, prep)
        grids.append((1, h // prep.patch_size, w // prep.patch_size))
    forwards: list[list[tuple[int, int, int]]] = [[]]
    for grid in grids:  # as BatchScheduler packs an arrival sequence
        if forwards[-1] and sum(t * h * w for t, h, w in forwards[-1]) + grid[1] * grid[2] > a.batch_tokens:
            forwards.append([])
        forwards[-1].append(grid)
    forwards = forwards[:-1][:16] or forwards  # full forwards only
    inputs = [torch.randn(sum(t * h * w for t, h, w in f), model.cfg.patch_dim, device=device, dtype=dtype)
              for f in forwards]

    def run_all() -> None:
        for x, f in zip(inputs, forwards, strict=True):
            model(x, f)

    with torch.inference_mode():
        seconds = time_median(run_all, device, 1, 3)
    num_images = sum(len(f) for f in forwards)
    num_patches = sum(x.shape[0] for x in inputs)
    return {"mix": a.mix, "batch_tokens": a.batch_tokens, "forwards": len(forwards), "images": num_images,
            "patches_per_img": num_patches / num_images, "img_s": num_images / seconds,
            "tflops": 2 * num_params * num_patches / seconds / 1e12}


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
    p.add_argument("--mix", default=None,
                   help="also time forwards packed from this image mix (as `mmenc bench serve --mix`): the "
                        "bare-forward ceiling for that mix")
    p.add_argument("--batch-tokens", type=int, default=32768, help="patches per forward in --mix mode "
                   "(the server's --max-batch-tokens)")
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
    mix_row = _mix_ceiling(ours, a, device, dtype, num_params) if a.mix else None
    payload = {"bench": "vit", "mix": mix_row, "preset": a.preset, "dtype": a.dtype, "params": num_params,
               "compile": a.compile, "env": environment(device),
               "argv": argv if argv is not None else sys.argv[1:], "rows": rows}
    path = write_results(a.name, a.out_dir, payload)
    cols = ["size", "batch", "patches", "ours_img_s", "ours_tflops", "ref_img_s", "ref_tflops", "speedup",
            "max_abs_diff"]
    print(markdown_table(rows, cols))
    best = max(rows, key=lambda r: r["ours_tflops"])
    if mix_row:
        print(f"mix {a.mix}: {mix_row['img_s']:.1f} img/s bare-forward ceiling "
              f"({mix_row['tflops']:.0f} TFLOP/s, {mix_row['patches_per_img']:.0f} patches/img, "
              f"{mix_row['batch_tokens']} patches/forward)")
    print(f"SUMMARY vit {a.preset} {a.dtype}: best {best['ours_tflops']:.0f} TFLOP/s ({best['ours_img_s']:.1f} img/s "
          f"at {best['size']}px x{best['batch']}); results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
