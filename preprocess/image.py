"""Image resize / normalize / patchify on the device, batched; matches transformers' `Qwen2VLImageProcessor`.

Per batch: uint8 images go to the device (pinned + non-blocking from the CPU), images of one source
shape are resized in one `tvF.resize` call (bicubic, antialias, on uint8 like transformers), images of
one target shape are rescaled+normalized in one fused multiply-add and patchified together, and one
`torch.cat` puts the patches back in input order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torchvision.transforms.v2 import functional as tvF

from preprocess.errors import MediaError

if TYPE_CHECKING:
    from encoder_server.config import PreprocessConfig


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 1280,
    max_aspect_ratio: float = 200.0,
) -> tuple[int, int]:
    """Target size: both sides multiples of `factor`, area within [min_pixels, max_pixels], aspect kept.

    The same arithmetic as transformers' `qwen2_vl.image_processing_qwen2_vl.smart_resize` (tiny images
    are scaled up to `min_pixels`, large ones down to `max_pixels`).

    Args:
        height, width: source size in pixels.
        factor: patch_size * merge_size.
        min_pixels, max_pixels: bounds on the target area.
        max_aspect_ratio: largest accepted max(h, w) / min(h, w).
    Returns:
        (target_height, target_width).
    Raises:
        MediaError: (400, `bad_aspect_ratio`) when the aspect ratio is above `max_aspect_ratio`,
            (400, `bad_image_size`) for an empty image.
    """
    if height < 1 or width < 1:
        raise MediaError(f"image has an empty size {width}x{height}", code="bad_image_size")
    ratio = max(height, width) / min(height, width)
    if ratio > max_aspect_ratio:
        raise MediaError(
            f"image aspect ratio {ratio:.1f} ({width}x{height}) is above the limit of {max_aspect_ratio:g}",
            code="bad_aspect_ratio", status=400,
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def target_size(height: int, width: int, cfg: PreprocessConfig) -> tuple[int, int]:
    """`smart_resize` with the limits of `cfg`."""
    return smart_resize(height, width, factor=cfg.patch_size * cfg.merge_size, min_pixels=cfg.min_pixels,
                        max_pixels=cfg.max_pixels, max_aspect_ratio=cfg.max_aspect_ratio)


def image_num_tokens(height: int, width: int, cfg: PreprocessConfig) -> int:
    """Embedding tokens an image of this source size yields after the patch merger.

    Args:
        height, width: source size in pixels (after EXIF orientation).
        cfg: the preprocessing config.
    Returns:
        grid_h * grid_w // merge_size**2.
    Raises:
        MediaError: aspect ratio above `cfg.max_aspect_ratio`.
    """
    h, w = target_size(height, width, cfg)
    return (h // cfg.patch_size) * (w // cfg.patch_size) // cfg.merge_size**2


@dataclass
class ImageBatch:
    """Patches of several images, concatenated without padding."""

    pixel_values: torch.Tensor  # [sum(seq_lens), C * temporal_patch * patch * patch], on the device
    grid_thw: torch.Tensor  # [N, 3] int64 on the CPU: (1, grid_h, grid_w) per image

    @property
    def seq_lens(self) -> list[int]:
        """Patches per image (before the merger), in input order."""
        return self.grid_thw.prod(dim=-1).tolist()

    @property
    def num_images(self) -> int:
        return self.grid_thw.shape[0]


def preprocess_images(
    images: list[torch.Tensor],
    cfg: PreprocessConfig,
    device: torch.device | str,
    out_dtype: torch.dtype = torch.float32,
) -> ImageBatch:
    """Resize, rescale+normalize and patchify a batch of images on `device`.

    Args:
        images: RGB uint8 tensors `[3, H, W]`, on the CPU or already on `device`.
        cfg: sizes, patch geometry and mean/std.
        device: where the work happens and where `pixel_values` ends up.
        out_dtype: dtype of `pixel_values` (normalization is computed in float32 first).
    Returns:
        An `ImageBatch`; image i owns rows `sum(seq_lens[:i]) : sum(seq_lens[:i+1])`.
    Raises:
        MediaError: an image's aspect ratio is above `cfg.max_aspect_ratio` (callers check items
            first with `image_num_tokens` so that one bad item does not fail a batch).
    """
    device = torch.device(device)
    ps, tps, merge = cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size
    patch_dim = 3 * tps * ps * ps
    for image in images:
        if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[0] != 3:
            raise ValueError(f"expected uint8 [3, H, W] images, got {image.dtype} {tuple(image.shape)}")
    targets = [target_size(image.shape[1], image.shape[2], cfg) for image in images]
    if not images:
        return ImageBatch(torch.empty(0, patch_dim, dtype=out_dtype, device=device),
                          torch.empty(0, 3, dtype=torch.int64))
    images = [to_device(image, device) for image in images]

    # Resize: one call per (source shape, target shape).
    resized: dict[tuple[int, int], list[tuple[list[int], torch.Tensor]]] = {}
    for (_, dst), idx in _group([(tuple(im.shape), t) for im, t in zip(images, targets, strict=True)]):
        stacked = _stack([images[i] for i in idx])  # [n, 3, H, W] uint8
        out = tvF.resize(stacked, list(dst), interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
        resized.setdefault(dst, []).append((idx, out))  # out: [n, 3, h, w] uint8

    # Normalize + patchify: one call per target shape.
    scale, bias = normalize_coeffs(cfg, device)  # [3, 1, 1] each
    patches_per_image: list[torch.Tensor] = [images[0]] * len(images)  # placeholders, all overwritten
    for parts in resized.values():
        idx = [i for part_idx, _ in parts for i in part_idx]
        stacked = torch.cat([out for _, out in parts]) if len(parts) > 1 else parts[0][1]  # [n, 3, h, w]
        # NOTE: uint8 * float32 promotes to float32: one fused multiply-add, no float copy of the input
        normed = torch.addcmul(bias, stacked, scale).to(out_dtype)  # [n, 3, h, w]
        patches = _patchify(normed, ps, merge, tps)  # [n, grid_h * grid_w, patch_dim]
        for j, i in enumerate(idx):
            patches_per_image[i] = patches[j]
    pixel_values = torch.cat(patches_per_image)  # [sum(seq_lens), patch_dim]
    grid_thw = torch.tensor([[1, h // ps, w // ps] for h, w in targets], dtype=torch.int64)  # [N, 3]
    return ImageBatch(pixel_values, grid_thw)


def _group(keys: list) -> list[tuple[object, list[int]]]:
    """Indices grouped by key, groups in order of first appearance."""
    groups: dict[object, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.items())


def _stack(images: list[torch.Tensor]) -> torch.Tensor:
    """`[3, H, W]` x n -> contiguous `[n, 3, H, W]` (no copy for one contiguous image)."""
    return images[0][None].contiguous() if len(images) == 1 else torch.stack(images)


def to_device(image: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device through pinned memory, non-blocking (the host never waits for queued device work)."""
    if image.device == device:
        return image
    if device.type == "cuda" and image.device.type == "cpu":
        # NOTE: the non-blocking copy is ordered before the resize on the same stream
        return image.pin_memory().to(device, non_blocking=True)
    return image.to(device)


def normalize_coeffs(cfg: PreprocessConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, bias) with x * scale + bias == (x / 255 - mean) / std, computed in float64 then float32."""
    mean = torch.tensor(cfg.image_mean, dtype=torch.float64)
    std = torch.tensor(cfg.image_std, dtype=torch.float64)
    scale = (1.0 / (255.0 * std)).view(3, 1, 1)  # [3, 1, 1]
    bias = (-mean / std).view(3, 1, 1)  # [3, 1, 1]
    return scale.to(device, torch.float32), bias.to(device, torch.float32)


def _patchify(
    images: torch.Tensor, patch_size: int, merge_size: int, temporal_patch_size: int
) -> torch.Tensor:
    """`[n, C, h, w]` -> `[n, grid_h * grid_w, C * tp * ps * ps]`, as transformers' `patchify`.

    Patches are ordered merge-window by merge-window (the merger's 2x2 neighbours are adjacent), and
    each still image is repeated `temporal_patch_size` times along time.
    """
    n, c, h, w = images.shape
    grid_h, grid_w = h // patch_size, w // patch_size
    patches = images.reshape(n, c, grid_h // merge_size, merge_size, patch_size,
                             grid_w // merge_size, merge_size, patch_size)
    patches = patches.permute(0, 2, 5, 3, 6, 1, 4, 7)  # [n, gh/m, gw/m, m, m, C, ps, ps]
    patches = patches.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, temporal_patch_size, -1, -1)
    return patches.reshape(n, grid_h * grid_w, c * temporal_patch_size * patch_size * patch_size)
