"""preprocess.decode: PIL / DALI (CPU) / nvJPEG (GPU) backends, odd modes, bad bytes, bombs."""

from __future__ import annotations

import importlib.util
import inspect
import io
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile, ImageOps
from transformers.image_transforms import convert_to_rgb

from preprocess.decode import apply_exif_orientation, decode_images, is_plain_jpeg, resolve_backend
from preprocess.errors import DecodeError, MediaError, MediaTooLarge

HAS_DALI = importlib.util.find_spec("nvidia.dali") is not None
needs_dali = pytest.mark.skipif(not HAS_DALI, reason="needs nvidia-dali")
CPU_BACKENDS = ["pil", pytest.param("dali", marks=needs_dali)]
# JPEG decoders may differ in IDCT rounding; on the CPU DALI uses libjpeg-turbo like Pillow (diff 0).
MAX_MEAN_ABS_DIFF = 1.5


def _encode(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def _blocks(height: int, width: int, seed: int = 0) -> Image.Image:
    """An RGB image of flat 8x8 blocks: JPEG keeps it nearly lossless, so orientations are visible."""
    rng = np.random.default_rng(seed)
    cells = rng.integers(0, 256, (height // 8, width // 8, 3), dtype=np.uint8)
    return Image.fromarray(np.kron(cells, np.ones((8, 8, 1), dtype=np.uint8)))


def _exif_jpeg(img: Image.Image, orientation: int) -> bytes:
    exif = img.getexif()
    exif[0x0112] = orientation
    return _encode(img, "JPEG", quality=95, subsampling=0, exif=exif.tobytes())  # 4:4:4: no chroma upsampling


def _png_1bit(width: int, height: int, raw: bytes = b"\0" * 64) -> bytes:
    """A 1-bit grayscale PNG of width x height from raw scanlines (the default: a header-only fake)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    signature = b"\x89PNG\r\n\x1a\n"
    return signature + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def _pixels(result: torch.Tensor | MediaError) -> np.ndarray:
    assert isinstance(result, torch.Tensor), result
    assert result.dtype == torch.uint8 and result.ndim == 3 and result.shape[0] == 3
    return result.permute(1, 2, 0).cpu().numpy()  # [H, W, 3]


@pytest.fixture
def dali_items(monkeypatch) -> list[int]:
    """Counts the items DALI itself decoded, so a test can tell DALI from the PIL fallback."""
    if not HAS_DALI:
        return []
    from preprocess.decode_dali import DaliDecoder

    counts: list[int] = []
    decode = DaliDecoder.decode

    def counting_decode(self, blobs):
        images = decode(self, blobs)
        counts.append(len(images))
        return images

    monkeypatch.setattr(DaliDecoder, "decode", counting_decode)
    return counts


@pytest.fixture(scope="module")
def photo_jpegs(sample_photos) -> list[bytes]:
    china, flower = (Image.fromarray(p) for p in sample_photos)
    return [_encode(china, "JPEG", quality=90), _encode(flower, "JPEG", quality=75)]


def test_resolve_backend():
    assert resolve_backend("auto", "cpu") == "pil"
    assert resolve_backend("auto", torch.device("cuda", 1)) == "nvjpeg"
    assert resolve_backend("dali", "cpu") == "dali"
    with pytest.raises(ValueError, match="unknown decode backend"):
        resolve_backend("opencv", "cpu")
    with pytest.raises(ValueError, match="CUDA"):
        decode_images([b""], backend="nvjpeg", device="cpu")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_photos_match_pillow(backend, photo_jpegs, dali_items):
    results = decode_images(photo_jpegs, backend=backend)
    assert sum(dali_items) == (2 if backend == "dali" else 0)
    for blob, result in zip(photo_jpegs, results, strict=True):
        expected = np.asarray(Image.open(io.BytesIO(blob)).convert("RGB")).astype(np.int16)
        got = _pixels(result).astype(np.int16)
        assert got.shape == expected.shape == (427, 640, 3)
        assert np.abs(got - expected).mean() < MAX_MEAN_ABS_DIFF


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_exif_orientation_applied(backend, dali_items):
    img = _blocks(40, 64)
    blobs = [_exif_jpeg(img, o) for o in range(1, 9)]
    results = decode_images(blobs, backend=backend)
    assert sum(dali_items) == (8 if backend == "dali" else 0)  # DALI applies EXIF orientation itself
    for orientation, blob, result in zip(range(1, 9), blobs, results, strict=True):
        expected = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(blob))).convert("RGB"))
        got = _pixels(result)
        assert got.shape == ((64, 40, 3) if orientation >= 5 else (40, 64, 3))
        assert np.abs(got.astype(np.int16) - expected).mean() < MAX_MEAN_ABS_DIFF


def _rgba() -> Image.Image:
    rgba = np.asarray(_blocks(16, 24).convert("RGBA")).copy()
    rgba[0, 0, 3] = 0  # fully transparent
    rgba[:, 8:16, 3] = 128  # half transparent
    return Image.fromarray(rgba)  # mode RGBA


def _palette_with_transparency() -> Image.Image:
    img = _blocks(16, 24).convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
    img.info["transparency"] = int(np.asarray(img)[0, 0])
    return img


ODD_MODES = {
    "RGBA-png": lambda: _encode(_rgba(), "PNG"),
    "LA-png": lambda: _encode(_rgba().convert("LA"), "PNG"),
    "P-transparent-png": lambda: _encode(_palette_with_transparency(), "PNG"),
    "P-gif": lambda: _encode(_blocks(16, 24).convert("P"), "GIF"),
    "L-jpeg": lambda: _encode(_blocks(16, 24).convert("L"), "JPEG"),
    "L-png": lambda: _encode(_blocks(16, 24).convert("L"), "PNG"),
    "CMYK-jpeg": lambda: _encode(_blocks(16, 24).convert("CMYK"), "JPEG"),
    "1-bit-png": lambda: _encode(_blocks(16, 24).convert("1"), "PNG"),
    "RGB-webp": lambda: _encode(_blocks(16, 24), "WEBP", lossless=True),
    "RGB-bmp": lambda: _encode(_blocks(16, 24), "BMP"),
}


def _white_composite_rgb(img: Image.Image) -> np.ndarray:
    """transformers' `image_transforms.convert_to_rgb` (5.24) for a Pillow image, as `[H, W, 3]`."""
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))
    return np.asarray(img.convert("RGB"))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", list(ODD_MODES))
def test_modes_match_transformers_convert_to_rgb(backend, kind):
    blob = ODD_MODES[kind]()
    expected = _white_composite_rgb(Image.open(io.BytesIO(blob)))  # [H, W, 3]
    if "return_numpy" in inspect.signature(convert_to_rgb).parameters:  # older versions differ
        assert np.array_equal(convert_to_rgb(Image.open(io.BytesIO(blob)), return_numpy=True), expected)
    got = _pixels(decode_images([blob], backend=backend)[0])
    assert np.array_equal(got, expected)


def test_transparent_pixel_becomes_white():
    got = _pixels(decode_images([_encode(_rgba(), "PNG")])[0])
    assert got[0, 0].tolist() == [255, 255, 255]


def test_sixteen_bit_keeps_high_byte():
    ramp = (np.arange(32 * 64, dtype=np.uint16).reshape(32, 64) * 32).astype(np.uint16)  # [H, W]
    blob = _encode(Image.fromarray(ramp), "PNG")  # mode I;16
    assert Image.open(io.BytesIO(blob)).mode in ("I;16", "I")
    got = _pixels(decode_images([blob])[0])
    assert np.array_equal(got, np.repeat((ramp >> 8).astype(np.uint8)[..., None], 3, axis=-1))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_bad_bytes_are_decode_errors(backend, photo_jpegs):
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False
    png = _encode(_blocks(64, 64), "PNG")
    bad = {
        "truncated jpeg": photo_jpegs[0][: len(photo_jpegs[0]) // 2],
        "truncated png": png[: len(png) // 2],
        "random bytes": np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes(),
        "jpeg magic then junk": b"\xff\xd8\xff" + b"\x00" * 100,
        "empty": b"",
    }
    results = decode_images(list(bad.values()), backend=backend)
    for name, result in zip(bad, results, strict=True):
        assert isinstance(result, DecodeError), name
        assert result.status == 415 and result.code == "undecodable_media" and result.message
    assert "empty" in results[-1].message


def test_pixel_limit_checked_on_header():
    blob = _encode(_blocks(40, 64), "PNG")
    (result,) = decode_images([blob], max_source_pixels=40 * 64 - 1)
    assert isinstance(result, MediaTooLarge) and result.status == 413
    assert "64x40" in result.message and str(40 * 64 - 1) in result.message
    assert isinstance(decode_images([blob], max_source_pixels=40 * 64)[0], torch.Tensor)


@pytest.mark.parametrize("size", [(9_000, 8_000), (20_000, 20_000)], ids=["72Mpx", "400Mpx"])
def test_real_big_png_rejected_before_decode(size):
    """Complete, valid all-black 1-bit PNGs of a few KB that would need 216 MB / 1.2 GB as RGB.

    72 Mpx trips our limit (64 Mpx); 400 Mpx already trips Pillow's own bomb check in `Image.open`.
    """
    width, height = size
    blob = _png_1bit(width, height, (b"\0" * (1 + width // 8)) * height)
    assert len(blob) < 300_000
    (result,) = decode_images([blob])
    assert isinstance(result, MediaTooLarge) and result.status == 413
    assert f"{width}x{height}" in result.message or "decompression bomb" in result.message


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_bad_items_do_not_disturb_good_ones(backend, photo_jpegs):
    good_png = _encode(_blocks(16, 24), "PNG")
    blobs = [photo_jpegs[0], _png_1bit(9000, 8000), b"junk", photo_jpegs[1][:5000], good_png, photo_jpegs[1]]
    results = decode_images(blobs, backend=backend)
    assert [type(r).__name__ for r in results] == [
        "Tensor", "MediaTooLarge", "DecodeError", "DecodeError", "Tensor", "Tensor"]
    alone = [decode_images([b], backend="pil")[0] for b in (photo_jpegs[0], good_png, photo_jpegs[1])]
    for got, expected in zip([results[0], results[4], results[5]], alone, strict=True):
        assert np.abs(_pixels(got).astype(np.int16) - _pixels(expected)).mean() < MAX_MEAN_ABS_DIFF


def _no_scan(jpeg: bytes) -> bytes:
    """A JPEG whose headers are fine (it opens) but whose scan is missing; it still ends in EOI."""
    return jpeg[: jpeg.index(b"\xff\xda")] + b"\xff\xd9"


def _bogus_huffman(jpeg: bytes) -> bytes:
    """A structurally sound JPEG (every marker in place) whose first Huffman table is invalid."""
    dht = jpeg.index(b"\xff\xc4")
    return jpeg[: dht + 5] + b"\xff" * 16 + jpeg[dht + 21:]


def test_is_plain_jpeg(photo_jpegs):
    def plain(blob: bytes, modes: tuple[str, ...] = ("RGB", "L")) -> bool:
        try:
            img = Image.open(io.BytesIO(blob))
        except Image.UnidentifiedImageError:  # Pillow < 13 does not open a JPEG without a scan
            return False
        return is_plain_jpeg(blob, img, modes)

    progressive = _encode(_blocks(16, 24), "JPEG", progressive=True)
    assert plain(photo_jpegs[0]) and plain(progressive) and plain(_bogus_huffman(photo_jpegs[0]))
    assert plain(photo_jpegs[0] + b"\0" * 10)  # trailing padding
    assert not plain(photo_jpegs[0][:-100])  # truncated
    assert not plain(_no_scan(photo_jpegs[0]))
    assert not plain(photo_jpegs[0], modes=("L",))
    assert not plain(_encode(_blocks(16, 24), "PNG"))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_apply_exif_orientation_matches_pillow(orientation):
    img = Image.fromarray(np.random.default_rng(orientation).integers(0, 256, (5, 7, 3), dtype=np.uint8))
    exif = img.getexif()
    exif[0x0112] = orientation
    img.info["exif"] = exif.tobytes()
    expected = np.asarray(ImageOps.exif_transpose(img))  # [H', W', 3]
    got = apply_exif_orientation(torch.from_numpy(np.array(img)).permute(2, 0, 1), orientation)
    assert np.array_equal(got.permute(1, 2, 0).numpy(), expected)


@needs_dali
def test_dali_chunks_large_batches_and_isolates_failures(dali_items):
    from preprocess.decode_dali import MAX_BATCH_SIZE

    blobs = [_encode(_blocks(16, 24, seed=i), "JPEG", quality=95) for i in range(MAX_BATCH_SIZE + 6)]
    bad = (3, MAX_BATCH_SIZE + 2)  # one in each chunk; each fails its whole DALI batch
    for i in bad:
        blobs[i] = _bogus_huffman(blobs[i])
    results = decode_images(blobs, backend="dali")
    assert sum(dali_items) == len(blobs) - len(bad)  # the good ones were still decoded by DALI
    for i, (blob, result) in enumerate(zip(blobs, results, strict=True)):
        if i in bad:
            assert isinstance(result, DecodeError)
        else:
            assert np.array_equal(_pixels(result), _pixels(decode_images([blob])[0]))


def test_importing_decode_does_not_import_dali():
    code = "import sys, preprocess.decode; assert 'nvidia.dali' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_dali_gives_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # makes `import nvidia.dali` fail
    monkeypatch.delitem(sys.modules, "preprocess.decode_dali", raising=False)
    with pytest.raises(ImportError, match=r"nvidia-dali|NVIDIA DALI"):
        decode_images([b"x"], backend="dali")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["nvjpeg", pytest.param("dali", marks=needs_dali)])
def test_gpu_backends_match_pillow(backend, photo_jpegs, monkeypatch):
    import torchvision.io

    nvjpeg_items: list[int] = []
    decode_jpeg = torchvision.io.decode_jpeg

    def counting_decode_jpeg(data, **kwargs):
        images = decode_jpeg(data, **kwargs)
        nvjpeg_items.append(len(data))
        return images

    monkeypatch.setattr(torchvision.io, "decode_jpeg", counting_decode_jpeg)
    blobs = photo_jpegs + [_exif_jpeg(_blocks(40, 64), 6), ODD_MODES["CMYK-jpeg"](), ODD_MODES["RGBA-png"]()]
    bad = [photo_jpegs[0][:3000], _no_scan(photo_jpegs[1]), _bogus_huffman(photo_jpegs[1]), b"junk"]
    results = decode_images(blobs + bad, backend=backend, device="cuda")
    assert [type(r).__name__ for r in results[len(blobs):]] == ["DecodeError"] * len(bad)
    if backend == "nvjpeg":  # the 3 RGB JPEGs (and the bogus-Huffman one, which fails there) on the GPU
        assert sum(nvjpeg_items) >= 3
    for result, expected in zip(results[: len(blobs)], decode_images(blobs, backend="pil"), strict=True):
        assert isinstance(result, torch.Tensor) and result.device.type == "cuda"
        assert result.shape == expected.shape
        mean_abs_diff = (result.cpu().float() - expected.float()).abs().mean().item()
        assert mean_abs_diff < MAX_MEAN_ABS_DIFF, (tuple(expected.shape), mean_abs_diff)
