"""preprocess.image against transformers' Qwen2VLImageProcessor (the torchvision backend)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchvision.transforms.v2 import functional as tvF
from transformers import Qwen2VLImageProcessor
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as hf_smart_resize

from encoder_server.config import PreprocessConfig
from preprocess.errors import MediaError
from preprocess.image import ImageBatch, image_num_tokens, preprocess_images, smart_resize

# NOTE: both sides resize the very same uint8 tensors with the same torchvision call, so the resized
# pixels are identical. What differs is the float32 arithmetic of normalization: transformers computes
# (x - 255 * mean) / (255 * std), we compute x * (1 / (255 * std)) - mean / std as one multiply-add.
# Outputs lie in about [-1.8, 2.2], where one float32 ulp is 2.4e-7; measured max-abs diff: 4.8e-7.
MAX_ABS_DIFF = 1e-6

SYNTHETIC_SIZES = [  # (height, width)
    (1, 150), (150, 1), (1, 200), (37, 1201), (3000, 20), (4000, 3000), (30, 30), (28, 28),
    (29, 57), (56, 56), (1, 1), (7, 13), (999, 1001),
]


@pytest.fixture(scope="module")
def processor() -> Qwen2VLImageProcessor:
    return Qwen2VLImageProcessor()


def _chw(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array)).permute(2, 0, 1)  # [3, H, W]


def _noise(height: int, width: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + height * 7919 + width)
    return torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=gen)  # [3, H, W]


def _photo_variants(photos: list[np.ndarray]) -> list[torch.Tensor]:
    china, flower = (_chw(p) for p in photos)
    return [
        china, flower,
        china[:, 13:400, 7:555],  # odd crop
        flower[:, :50, :80],  # small crop: the upscale-to-min_pixels path
        tvF.resize(china, [1333, 2000], antialias=True),  # large: the downscale-to-max_pixels path
        tvF.resize(flower, [300, 41], antialias=True),  # tall
    ]


def _reference(
    processor: Qwen2VLImageProcessor, images: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    out = processor(images=images, return_tensors="pt", input_data_format="channels_first")
    return out["pixel_values"], out["image_grid_thw"]


def _assert_matches(batch: ImageBatch, ref_pixels: torch.Tensor, ref_grid: torch.Tensor) -> None:
    assert torch.equal(batch.grid_thw, ref_grid)
    assert batch.pixel_values.shape == ref_pixels.shape
    assert (batch.pixel_values - ref_pixels).abs().max().item() <= MAX_ABS_DIFF


def test_photos_match_transformers(processor, sample_photos):
    images = _photo_variants(sample_photos)
    _assert_matches(preprocess_images(images, PreprocessConfig(), "cpu"), *_reference(processor, images))


@pytest.mark.parametrize("size", SYNTHETIC_SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_odd_sizes_match_transformers(processor, size):
    images = [_noise(*size)]
    _assert_matches(preprocess_images(images, PreprocessConfig(), "cpu"), *_reference(processor, images))


def test_custom_limits_match_transformers(sample_photos):
    cfg = PreprocessConfig(min_pixels=128 * 28 * 28, max_pixels=256 * 28 * 28)
    # NOTE: a fresh `size` dict; transformers 5.17 let `min_pixels=`/`max_pixels=` leak into other instances
    processor = Qwen2VLImageProcessor(size={"shortest_edge": cfg.min_pixels, "longest_edge": cfg.max_pixels})
    images = _photo_variants(sample_photos) + [_noise(30, 30)]
    _assert_matches(preprocess_images(images, cfg, "cpu"), *_reference(processor, images))


def test_batch_equals_each_image_alone(sample_photos):
    cfg = PreprocessConfig()
    photos = _photo_variants(sample_photos)
    # Shared source shapes, and different source shapes that share a target shape (both 28x28 grids).
    images = [photos[0], _noise(37, 1201), photos[1], _noise(28, 28), photos[2], _noise(30, 30), photos[0]]
    batch = preprocess_images(images, cfg, "cpu")
    alone = [preprocess_images([image], cfg, "cpu") for image in images]
    assert torch.equal(batch.grid_thw, torch.cat([a.grid_thw for a in alone]))
    assert torch.equal(batch.pixel_values, torch.cat([a.pixel_values for a in alone]))
    assert batch.seq_lens == [a.pixel_values.shape[0] for a in alone]
    assert batch.num_images == len(images)


def test_output_dtype_and_layout(sample_photos):
    cfg = PreprocessConfig()
    images = _photo_variants(sample_photos)[:2]
    fp32 = preprocess_images(images, cfg, "cpu")
    bf16 = preprocess_images(images, cfg, "cpu", out_dtype=torch.bfloat16)
    assert bf16.pixel_values.dtype == torch.bfloat16
    assert torch.equal(bf16.pixel_values, fp32.pixel_values.to(torch.bfloat16))
    assert fp32.grid_thw.dtype == torch.int64 and fp32.grid_thw.device.type == "cpu"
    assert fp32.pixel_values.shape[1] == 3 * cfg.temporal_patch_size * cfg.patch_size**2
    assert fp32.grid_thw[:, 0].eq(1).all()


def test_empty_batch():
    batch = preprocess_images([], PreprocessConfig(), "cpu")
    assert batch.pixel_values.shape == (0, 1176) and batch.grid_thw.shape == (0, 3) and batch.seq_lens == []


def test_rejects_non_uint8_or_non_rgb():
    with pytest.raises(ValueError, match="uint8"):
        preprocess_images([torch.zeros(3, 30, 30)], PreprocessConfig(), "cpu")
    with pytest.raises(ValueError, match="uint8"):
        preprocess_images([torch.zeros(4, 30, 30, dtype=torch.uint8)], PreprocessConfig(), "cpu")


@pytest.mark.parametrize("size", [(1, 250), (250, 1), (3, 1000)])
def test_extreme_aspect_ratio_rejected(size):
    with pytest.raises(MediaError) as info:
        preprocess_images([_noise(*size)], PreprocessConfig(), "cpu")
    assert info.value.status == 400 and info.value.code == "bad_aspect_ratio"
    ratio = max(size) / min(size)
    assert f"{ratio:.1f}" in info.value.message and "200" in info.value.message
    with pytest.raises(MediaError):
        image_num_tokens(*size, PreprocessConfig())


def test_aspect_ratio_limit_is_configurable():
    assert smart_resize(1, 150)[0] > 0
    with pytest.raises(MediaError, match="aspect ratio"):
        smart_resize(1, 150, max_aspect_ratio=100.0)
    with pytest.raises(MediaError, match="empty"):
        smart_resize(0, 10)


@settings(max_examples=300, deadline=None)
@given(
    height=st.integers(1, 20_000),
    width=st.integers(1, 20_000),
    min_tokens=st.sampled_from([4, 16, 128]),
    max_tokens=st.sampled_from([256, 1280, 16384]),
)
def test_smart_resize_matches_transformers(height, width, min_tokens, max_tokens):
    kwargs = dict(factor=28, min_pixels=min_tokens * 28 * 28, max_pixels=max_tokens * 28 * 28)
    try:
        expected = hf_smart_resize(height, width, **kwargs)
    except ValueError:
        with pytest.raises(MediaError):
            smart_resize(height, width, **kwargs)
        return
    assert smart_resize(height, width, **kwargs) == expected


def test_image_num_tokens_matches_processor(processor, sample_photos):
    cfg = PreprocessConfig()
    images = _photo_variants(sample_photos) + [_noise(*s) for s in SYNTHETIC_SIZES[:5]]
    _, grid = _reference(processor, images)
    for image, (t, h, w) in zip(images, grid.tolist(), strict=True):
        height, width = image.shape[1:]
        assert image_num_tokens(height, width, cfg) == t * h * w // cfg.merge_size**2
        num_patches = processor.get_number_of_image_patches(height, width)
        assert image_num_tokens(height, width, cfg) * cfg.merge_size**2 == num_patches


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_transformers_on_cuda(sample_photos):
    processor = Qwen2VLImageProcessor()
    images = _photo_variants(sample_photos) + [_noise(*size) for size in SYNTHETIC_SIZES]
    batch = preprocess_images(images, PreprocessConfig(), "cuda")  # from the CPU, through pinned memory
    assert batch.pixel_values.device.type == "cuda"
    out = processor(images=[image.cuda() for image in images], return_tensors="pt",
                    input_data_format="channels_first")
    assert out["pixel_values"].device.type == "cuda"
    assert torch.equal(batch.grid_thw, out["image_grid_thw"].cpu())
    assert (batch.pixel_values - out["pixel_values"]).abs().max().item() <= MAX_ABS_DIFF
