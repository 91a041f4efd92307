"""`mmenc bench preprocess`: 1080p JPEG -> model-ready patches, ours vs transformers, same run.

Ours: batched decode (nvjpeg on CUDA, PIL on CPU, DALI if installed) + resize/normalize/patchify on the
device. Baseline: PIL decode + transformers `Qwen2VLImageProcessor` on CPU and on the device.
All start from JPEG bytes in memory and end with `pixel_values` on the device.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from bench.common import environment, markdown_table, sync, write_results
from encoder_server.config import PreprocessConfig
from preprocess.decode import decode_images
from preprocess.image import preprocess_images


def make_jpegs(num: int, width: int, height: int, seed: int = 0) -> list[bytes]:
    """Photo-like synthetic JPEGs (smooth gradients, shapes, mild noise), quality 90, all different."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    out = []
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    for _ in range(num):
        fx, fy, phase = rng.uniform(0.002, 0.02, 2).tolist() + [rng.uniform(0, 6.28)]
        base = np.stack([127 + 100 * np.sin(fx * xx + phase), 127 + 100 * np.cos(fy * yy),
                         127 + 100 * np.sin(fx * xx + fy * yy)], axis=-1)
        base += rng.normal(0, 6, base.shape)
        img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
        draw = ImageDraw.Draw(img)
        for _ in range(12):
            x0, y0 = int(rng.integers(0, width - 200)), int(rng.integers(0, height - 200))
            draw.ellipse([x0, y0, x0 + int(rng.integers(40, 200)), y0 + int(rng.integers(40, 200))],
                         fill=tuple(int(c) for c in rng.integers(0, 255, 3)))
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def _rate(fn: Callable[[], Any], num_images: int, device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return num_images / float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mmenc bench preprocess", description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--num-images", type=int, default=64)
    p.add_argument("--batch", type=int, default=32, help="images per batched call (ours and the device baseline)")
    p.add_argument("--width", type=int, default=1920)
    p.add_argument("--height", type=int, default=1080)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backends", default="auto", help="comma list of pil,nvjpeg,dali (auto: what this machine has)")
    p.add_argument("--cpu-baseline-images", type=int, default=16)
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--name", default="preprocess")
    a = p.parse_args(argv)

    from PIL import Image
    from transformers import Qwen2VLImageProcessor

    device = torch.device(a.device)
    cfg = PreprocessConfig()
    jpegs = make_jpegs(a.num_images, a.width, a.height)
    chunks = [jpegs[i:i + a.batch] for i in range(0, len(jpegs), a.batch)]
    if a.backends == "auto":
        backends = ["pil"] + (["nvjpeg"] if device.type == "cuda" else [])
        try:
            import nvidia.dali  # noqa: F401

            backends.append("dali")
        except ImportError:
            pass
    else:
        backends = a.backends.split(",")

    rows: list[dict[str, Any]] = []

    def ours(backend: str) -> None:
        for chunk in chunks:
            images = decode_images(chunk, backend, device if backend != "pil" else "cpu")
            preprocess_images(images, cfg, device, out_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)

    for backend in backends:
        rate = _rate(lambda b=backend: ours(b), len(jpegs), device, a.repeats)
        rows.append({"pipeline": f"mmenc decode={backend} + preprocess on {device.type}", "img_s": rate,
                     "ms_per_img": 1e3 / rate})
        print(rows[-1], flush=True)

    processor = Qwen2VLImageProcessor()

    def baseline(dev: str, subset: list[bytes]) -> None:
        for i in range(0, len(subset), a.batch):
            images = [Image.open(io.BytesIO(b)).convert("RGB") for b in subset[i:i + a.batch]]
            processor(images=images, return_tensors="pt", device=dev)["pixel_values"].to(device)

    subset = jpegs[:a.cpu_baseline_images]
    rate = _rate(lambda: baseline("cpu", subset), len(subset), device, max(1, a.repeats // 2))
    rows.append({"pipeline": "transformers PIL decode + Qwen2VLImageProcessor on cpu", "img_s": rate,
                 "ms_per_img": 1e3 / rate})
    print(rows[-1], flush=True)
    if device.type == "cuda":
        rate = _rate(lambda: baseline("cuda", jpegs), len(jpegs), device, a.repeats)
        rows.append({"pipeline": "transformers PIL decode + Qwen2VLImageProcessor on cuda", "img_s": rate,
                     "ms_per_img": 1e3 / rate})
        print(rows[-1], flush=True)

    base = rows[-1]["img_s"]
    for row in rows:
        row["vs_transformers_best"] = row["img_s"] / base
    payload = {"bench": "preprocess", "image": f"{a.width}x{a.height} JPEG q90", "num_images": len(jpegs),
               "batch": a.batch, "env": environment(device), "argv": argv if argv is not None else sys.argv[1:],
               "rows": rows}
    path = write_results(a.name, a.out_dir, payload)
    print(markdown_table(rows, ["pipeline", "img_s", "ms_per_img", "vs_transformers_best"]))
    best = max(rows, key=lambda r: r["img_s"])
    print(f"SUMMARY preprocess {a.width}x{a.height}: best {best['img_s']:.0f} img/s ({best['pipeline']}), "
          f"{best['img_s'] / base:.1f}x transformers on {device.type}; results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
