"""Bytes -> RGB uint8 image tensors `[3, H, W]`, through pluggable decode backends.

Backends (a tiny registry, imported only when chosen):
- `pil`: Pillow on the CPU; the reference behaviour every other backend falls back to.
- `nvjpeg`: JPEGs in one batched `torchvision.io.decode_jpeg(..., device="cuda")` call; others via PIL.
- `dali`: an NVIDIA DALI pipeline (`preprocess/decode_dali.py`), CPU-only or `mixed` on a GPU.

Every backend first reads the header only (Pillow opens lazily) and rejects images above
`max_source_pixels` before any pixel is decoded. A bad item becomes a `MediaError` in its own slot;
it never raises and never affects the other items of the batch.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import struct
from collections.abc import Callable, Iterator

import numpy as np
import torch
from PIL import Image, ImageOps

from preprocess.errors import DecodeError, MediaError, MediaTooLarge

DecodeResult = torch.Tensor | MediaError
DecodeFn = Callable[[list[bytes], torch.device, int], list[DecodeResult]]

# NOTE: only formats a browser would show; Pillow's other plugins (EPS, PSD, ...) stay unreachable.
ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
JPEG_FORMATS = ("JPEG", "MPO")  # Pillow opens multi-picture JPEGs (phone cameras) as MPO
JPEG_SOI = b"\xff\xd8\xff"
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")
# Errors Pillow raises on malformed input (Pillow's own fuzzers allow exactly these).
_PIL_ERRORS = (OSError, ValueError, SyntaxError, EOFError, struct.error, IndexError, TypeError)

# name -> (module, function); the module is imported on first use only.
_BACKENDS: dict[str, tuple[str, str]] = {
    "pil": ("preprocess.decode", "decode_pil"),
    "nvjpeg": ("preprocess.decode", "decode_nvjpeg"),
    "dali": ("preprocess.decode_dali", "decode_dali"),
}
_INSTALL_HINT = {"dali": "it needs NVIDIA DALI: pip install 'mmenc[dali]'"}


def resolve_backend(name: str, device: torch.device | str) -> str:
    """Map `auto` to a concrete backend: `nvjpeg` on a CUDA device, else `pil`.

    Args:
        name: `auto`, `pil`, `nvjpeg` or `dali`.
        device: the device the decoded images should end up on.
    Returns:
        The concrete backend name.
    """
    if name == "auto":
        return "nvjpeg" if torch.device(device).type == "cuda" else "pil"
    if name not in _BACKENDS:
        raise ValueError(f"unknown decode backend {name!r}; known: auto, {', '.join(_BACKENDS)}")
    return name


def decode_images(
    blobs: list[bytes],
    backend: str = "pil",
    device: torch.device | str = "cpu",
    max_source_pixels: int = 64_000_000,
) -> list[DecodeResult]:
    """Decode encoded images (JPEG, PNG, WebP, GIF, BMP, TIFF) to RGB.

    Args:
        blobs: encoded images, one per item.
        backend: `auto`, `pil`, `nvjpeg` (CUDA only) or `dali`.
        device: where GPU backends put their output; `pil` always returns CPU tensors.
        max_source_pixels: largest accepted width * height of the source (decompression-bomb guard).
    Returns:
        Per input blob, in order: a uint8 tensor `[3, H, W]` (EXIF orientation applied, transparency
        composited on white) or the `MediaError` (`DecodeError`, `MediaTooLarge`) for that item.
    """
    device = torch.device(device)
    name = resolve_backend(backend, device)
    if name == "nvjpeg" and device.type != "cuda":
        raise ValueError(f"decode backend 'nvjpeg' needs a CUDA device, got {device}")
    return _load_backend(name)(list(blobs), device, max_source_pixels)


def _load_backend(name: str) -> DecodeFn:
    module_name, fn_name = _BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        hint = _INSTALL_HINT.get(name, f"module {module_name} failed to import")
        raise ImportError(f"decode backend {name!r} is not available: {hint} ({e})") from e
    return getattr(module, fn_name)


# --------------------------------------------------------------------------------------------- PIL


@contextlib.contextmanager
def _as_media_error() -> Iterator[None]:
    """Turn Pillow's exceptions about the bytes into this item's `MediaError`."""
    try:
        yield
    except MediaError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        # NOTE: the warning only arrives here when a warnings filter escalates it to an error.
        raise MediaTooLarge(f"image rejected as a decompression bomb: {e}") from e
    except Image.UnidentifiedImageError as e:
        raise DecodeError(f"not an image in a supported format ({', '.join(ALLOWED_FORMATS)})") from e
    except _PIL_ERRORS as e:
        raise DecodeError(f"cannot decode image: {e}") from e


def open_image(blob: bytes, max_source_pixels: int) -> Image.Image:
    """Read only the header of `blob` and check its size; no pixel is decoded yet.

    Args:
        blob: the encoded image.
        max_source_pixels: largest accepted width * height.
    Returns:
        A lazily loaded Pillow image (`.format`, `.mode`, `.size` are known).
    Raises:
        DecodeError: empty, not an image, or an unsupported format.
        MediaTooLarge: width * height above `max_source_pixels`.
    """
    if not blob:
        raise DecodeError("empty image data (0 bytes)")
    with _as_media_error():
        img = Image.open(io.BytesIO(blob), formats=ALLOWED_FORMATS)
    width, height = img.size
    if width <= 0 or height <= 0:
        raise DecodeError(f"image has an empty size {width}x{height}")
    if width * height > max_source_pixels:
        raise MediaTooLarge(
            f"image is {width}x{height} = {width * height} pixels, "
            f"above the limit of {max_source_pixels} pixels"
        )
    return img


def pil_to_tensor(img: Image.Image) -> torch.Tensor:
    """Decode a (lazy) Pillow image to RGB uint8 `[3, H, W]`.

    EXIF orientation is applied. Transparency (RGBA, LA, P or L with a transparent colour) is
    composited on white exactly like transformers' `convert_to_rgb`. 16-bit grayscale (`I;16*`, `I`)
    keeps its high byte (`>> 8`, values clipped to [0, 65535] first); float (`F`) is clipped to
    [0, 255] as Pillow's `convert("L")` does. CMYK, YCbCr, 1-bit and the rest use `convert("RGB")`.

    Raises:
        DecodeError: truncated or corrupt pixel data.
    """
    with _as_media_error():
        img.load()  # NOTE: raises on truncated data as long as ImageFile.LOAD_TRUNCATED_IMAGES stays False
        img = ImageOps.exif_transpose(img)
        if img.mode in _SIXTEEN_BIT_MODES:
            gray = np.asarray(img).astype(np.int64).clip(0, 65535) >> 8  # [H, W]
            img = Image.fromarray(gray.astype(np.uint8))  # mode L
        has_alpha = "A" in img.getbands() or img.info.get("transparency") is not None
        if has_alpha:
            rgba = img.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            img = Image.alpha_composite(white, rgba).convert("RGB")
        elif img.mode != "RGB":
            img = img.convert("RGB")
        pixels = np.array(img)  # [H, W, 3]; NOTE: np.asarray would be a read-only view torch warns about
    return torch.from_numpy(pixels).permute(2, 0, 1)  # [3, H, W]


def is_plain_jpeg(blob: bytes, img: Image.Image, modes: tuple[str, ...]) -> bool:
    """A structurally sound baseline/progressive JPEG in one of `modes`, fit for a GPU decoder.

    NOTE: nvJPEG (torchvision 0.26) decodes a truncated JPEG without complaint and crashed the process
    (SIGSEGV) on one without a scan, so only JPEGs whose markers walk cleanly from SOI through a
    SOF0/1/2 frame to a scan, and which end in EOI, go to the GPU. PIL takes the rest and either
    decodes them or says what is wrong.
    """
    if img.format not in JPEG_FORMATS or img.mode not in modes:
        return False
    return _jpeg_frame_marker(blob) in (0xC0, 0xC1, 0xC2)


def _jpeg_frame_marker(blob: bytes) -> int | None:
    """The SOFn marker of a JPEG with SOI, well-formed segments, a frame, a scan and a final EOI."""
    if blob[:3] != JPEG_SOI or not blob[-64:].rstrip(b"\x00\r\n\t ").endswith(b"\xff\xd9"):
        return None
    pos, frame = 2, None
    while pos + 4 <= len(blob):
        if blob[pos] != 0xFF:
            return None
        marker = blob[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        length = int.from_bytes(blob[pos + 2:pos + 4], "big")
        if length < 2 or pos + 2 + length > len(blob):
            return None
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            frame = marker
        elif marker == 0xDA:  # start of scan: the entropy-coded data follows
            return frame
        pos += 2 + length
    return None


def exif_orientation(img: Image.Image) -> int | None:
    """The EXIF orientation (1..8) Pillow's `exif_transpose` would apply; None if the EXIF is broken."""
    try:
        orientation = img.getexif().get(0x0112, 1)
    except _PIL_ERRORS:
        return None
    return orientation if orientation in range(1, 9) else 1


def apply_exif_orientation(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """`[C, H, W]` as Pillow's `ImageOps.exif_transpose` would turn it (any device)."""
    if orientation in (5, 6, 7, 8):
        image = torch.rot90(image, k=1 if orientation in (5, 8) else -1, dims=(-2, -1))  # [C, W, H]
    if orientation in (2, 3):
        image = image.flip(-1)
    if orientation in (3, 4, 5, 7):
        image = image.flip(-2)
    return image


def decode_one_pil(blob: bytes, max_source_pixels: int) -> DecodeResult:
    """Decode one blob with Pillow; a `MediaError` is returned, not raised."""
    try:
        return pil_to_tensor(open_image(blob, max_source_pixels))
    except MediaError as e:
        return e


def decode_pil(blobs: list[bytes], device: torch.device, max_source_pixels: int) -> list[DecodeResult]:
    """The `pil` backend: one item at a time on the CPU (the output stays on the CPU)."""
    return [decode_one_pil(blob, max_source_pixels) for blob in blobs]


# ------------------------------------------------------------------------------------------ nvJPEG


def decode_nvjpeg(blobs: list[bytes], device: torch.device, max_source_pixels: int) -> list[DecodeResult]:
    """The `nvjpeg` backend: baseline/progressive RGB or gray JPEGs on the GPU in one batched call.

    Other images (PNG, CMYK JPEG, ...), JPEGs `is_plain_jpeg` does not trust and JPEGs nvJPEG refuses
    go through PIL and are copied to `device`. EXIF orientation is applied on the GPU afterwards. The
    header and pixel-limit checks run on the CPU before anything reaches the GPU.
    """
    import torchvision.io

    results: list[DecodeResult | None] = [None] * len(blobs)
    orientations: dict[int, int] = {}  # NOTE: torchvision ignores apply_exif_orientation on CUDA
    for i, blob in enumerate(blobs):
        try:
            img = open_image(blob, max_source_pixels)
        except MediaError as e:
            results[i] = e
            continue
        orientation = exif_orientation(img)
        if orientation is not None and is_plain_jpeg(blob, img, ("RGB", "L")):
            orientations[i] = orientation
        else:
            results[i] = to_device(decode_one_pil(blob, max_source_pixels), device)
    gpu_items = list(orientations)

    def decode(idx: list[int]) -> list[torch.Tensor]:
        data = [torch.frombuffer(bytearray(blobs[i]), dtype=torch.uint8) for i in idx]  # [num_bytes] each
        images = torchvision.io.decode_jpeg(data, mode=torchvision.io.ImageReadMode.RGB, device=device)
        return [apply_exif_orientation(im, orientations[i]) for i, im in zip(idx, images, strict=True)]

    if gpu_items:
        try:
            decoded = decode(gpu_items)
        except RuntimeError:
            decoded = []
        if len(decoded) == len(gpu_items):
            for i, image in zip(gpu_items, decoded, strict=True):
                results[i] = image  # [3, H, W] on device
        else:  # one bad item fails the whole batched call: isolate it
            for i in gpu_items:
                try:
                    results[i] = decode([i])[0]
                except RuntimeError:  # nvJPEG cannot: PIL decodes it or says what is wrong
                    results[i] = to_device(decode_one_pil(blobs[i], max_source_pixels), device)
    return results  # type: ignore[return-value]


def to_device(result: DecodeResult, device: torch.device) -> DecodeResult:
    """Move a decoded image to `device`; a `MediaError` passes through."""
    return result.to(device) if isinstance(result, torch.Tensor) else result


def displayed_size(blob: bytes, max_source_pixels: int) -> tuple[int, int]:
    """(height, width) of the decoded image, EXIF orientation applied, from the header alone.

    Raises the same errors as `open_image`.
    """
    img = open_image(blob, max_source_pixels)
    width, height = img.size
    return (width, height) if exif_orientation(img) in (5, 6, 7, 8) else (height, width)
