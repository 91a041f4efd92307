"""Hostile bytes into the real decoders: a decoded result or a 4xx `MediaError`, never another exception, a hang
or a big allocation.

Random bytes and mutated valid files (truncated, bytes flipped, junk inserted or appended) go through image
decode (`open_image`, the PIL backend), `probe_video` / `read_video` (with a deadline) and `decode_audio`.
Crafted files: decompression bombs (PNG, JPEG, GIF, TIFF, BMP, WebP headers claiming ~30000x30000 pixels;
FLAC and MP3 streams of tiny frames that decode to hours), polyglots, containers with absurd dimensions,
frame rates and frame counts, WAV headers with absurd rates, channels, bits and sizes. Bombs run under an
address-space cap, so an allocation of the claimed size fails the test instead of swapping the machine.
"""

from __future__ import annotations

import contextlib
import io
import resource
import struct
import time
import zlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from preprocess.audio import decode_audio, max_decoded_samples
from preprocess.decode import decode_images, open_image
from preprocess.errors import MediaError
from preprocess.fetch import FetchPolicy, fetch_media
from preprocess.media_read import VideoRead, read_video
from preprocess.video_decode import probe_video
from preprocess.video_sampling import VideoSampling
from tests.media_video import make_video

FUZZ = settings(max_examples=60, deadline=3000, suppress_health_check=list(HealthCheck), derandomize=True)
SLOW_FUZZ = settings(FUZZ, max_examples=25, deadline=10_000)
MiB = 1 << 20


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


@contextlib.contextmanager
def address_space_cap(extra: int) -> Iterator[None]:
    """Cap this process's address space at its current size + `extra` bytes: a bigger allocation fails."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_vm_bytes() + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_address_space_cap_catches_a_big_allocation() -> None:
    """The cap the bomb tests run under does fail an allocation of the size a bomb claims."""
    with address_space_cap(64 * MiB), pytest.raises(MemoryError):
        np.empty(256 * MiB, np.uint8)
    assert np.empty(256 * MiB, np.uint8).size == 256 * MiB  # and is lifted afterwards


def assert_4xx(error: BaseException) -> None:
    assert isinstance(error, MediaError), f"{type(error).__name__}: {error}"
    assert 400 <= error.status < 500 and error.message and error.code, (error.status, error.message)


def media_outcome(fn, *args, **kwargs):
    """`fn(...)`, or the MediaError it raised (asserted 4xx); any other exception fails the test."""
    try:
        return fn(*args, **kwargs)
    except MediaError as e:
        assert_4xx(e)
        return e


def mutate(data: st.DataObject, blob: bytes) -> bytes:
    """Truncate, flip bytes, insert or append junk, overwrite a header field: 1 to 4 times."""
    out = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["truncate", "flip", "insert", "append", "overwrite"]))
        i = data.draw(st.integers(0, max(len(out) - 1, 0)))
        if op == "truncate":
            del out[i:]
        elif op == "flip" and out:
            out[i] ^= data.draw(st.integers(1, 255))
        elif op == "insert":
            out[i:i] = data.draw(st.binary(min_size=1, max_size=16))
        elif op == "append":
            out += data.draw(st.binary(min_size=1, max_size=256))
        elif op == "overwrite":
            out[i:i + 4] = data.draw(st.sampled_from([b"\xff\xff\xff\xff", b"\x00\x00\x00\x00", b"\x7f\xff\xff\xff",
                                                      b"\x80\x00\x00\x00"]))
    return bytes(out)


# ----------------------------------------------------------------------------------------------------- images


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def _valid_images() -> list[bytes]:
    rgb = Image.fromarray((np.arange(24 * 32 * 3) % 251).astype(np.uint8).reshape(24, 32, 3))
    return [_encode(rgb, "PNG"), _encode(rgb.convert("RGBA"), "PNG"), _encode(rgb.convert("P"), "PNG"),
            _encode(rgb.convert("I;16"), "PNG"), _encode(rgb, "JPEG", quality=80),
            _encode(rgb, "JPEG", progressive=True), _encode(rgb.convert("CMYK"), "JPEG"), _encode(rgb, "GIF"),
            _encode(rgb, "BMP"), _encode(rgb, "TIFF"), _encode(rgb, "TIFF", compression="tiff_lzw"),
            _encode(rgb, "WEBP"), _encode(rgb.convert("LA"), "PNG")]


VALID_IMAGES = _valid_images()
IMAGE_MAGIC = [b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF89a", b"GIF87a", b"BM", b"II*\x00", b"MM\x00*",
               b"RIFF\x00\x00\x00\x00WEBPVP8 ", b"RIFF\x00\x00\x00\x00WEBPVP8L", b""]


def check_image(blob: bytes) -> None:
    """`open_image` raises only a 4xx MediaError; the PIL backend returns `[3, H, W]` uint8 or one."""
    media_outcome(open_image, blob, 1 << 20)
    (out,) = decode_images([blob], "pil", "cpu", max_source_pixels=1 << 20)
    if isinstance(out, torch.Tensor):
        assert out.dtype == torch.uint8 and out.ndim == 3 and out.shape[0] == 3
        assert out.shape[1] * out.shape[2] <= 1 << 20
    else:
        assert_4xx(out)


@FUZZ
@given(st.sampled_from(IMAGE_MAGIC), st.binary(max_size=512))
def test_image_random_bytes(magic: bytes, tail: bytes) -> None:
    with address_space_cap(512 * MiB):
        check_image(magic + tail)


@FUZZ
@given(st.data())
def test_image_mutations(data: st.DataObject) -> None:
    blob = mutate(data, data.draw(st.sampled_from(VALID_IMAGES)))
    with address_space_cap(512 * MiB):
        check_image(blob)


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_bomb(width: int, height: int) -> bytes:
    """A valid PNG header for width x height RGB with a tiny zlib stream of zero rows: a few hundred bytes."""
    stream = zlib.compressobj(9)
    idat = stream.compress(b"\0" * (1 + 3 * min(width, 4096)) * 64) + stream.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


def gif_bomb(width: int, height: int) -> bytes:
    """A GIF whose logical screen (and one image) is width x height; the LZW data is a few bytes."""
    return (b"GIF89a" + struct.pack("<HHBBB", width, height, 0, 0, 0) + b"," + struct.pack("<HHHHB", 0, 0, width,
                                                                                             height, 0)
            + b"\x02\x02\x44\x01\x00;")


def jpeg_bomb(width: int, height: int) -> bytes:
    """A real small JPEG with its SOF0 frame header patched to width x height."""
    blob = bytearray(_encode(Image.new("RGB", (16, 16), (90, 10, 200)), "JPEG"))
    sof = blob.index(b"\xff\xc0")
    blob[sof + 5:sof + 9] = struct.pack(">HH", height, width)
    return bytes(blob)


def tiff_bomb(width: int, height: int) -> bytes:
    """A little-endian TIFF whose IFD says width x height, 8-bit gray, one tiny uncompressed strip."""
    tags = [(256, 4, width), (257, 4, height), (258, 3, 8), (259, 3, 1), (262, 3, 1), (273, 4, 8), (277, 3, 1),
            (278, 4, height), (279, 4, 16)]
    ifd = struct.pack("<H", len(tags)) + b"".join(struct.pack("<HHII", tag, kind, 1, value)
                                                  for tag, kind, value in tags) + b"\0\0\0\0"
    return b"II*\x00" + struct.pack("<I", 24) + b"\0" * 16 + ifd


def bmp_bomb(width: int, height: int) -> bytes:
    """A 24-bit BMP header claiming width x height with 64 bytes of pixel data."""
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, 0, 2835, 2835, 0, 0)
    return b"BM" + struct.pack("<IHHI", 14 + 40 + 64, 0, 0, 54) + info + b"\0" * 64


def webp_bomb() -> bytes:
    """A real small lossless WebP with its VP8L header patched to the largest size, 16384x16384."""
    blob = bytearray(_encode(Image.new("RGB", (16, 16)), "WEBP", lossless=True))
    pos = blob.index(b"VP8L") + 8  # signature byte 0x2f, then 14 bits width-1, 14 bits height-1
    bits = int.from_bytes(blob[pos + 1:pos + 5], "little")
    bits = (bits & ~((1 << 28) - 1)) | 16383 | (16383 << 14)
    blob[pos + 1:pos + 5] = bits.to_bytes(4, "little")
    return bytes(blob)


BOMBS = {"png": png_bomb(30000, 30000), "png-under-pillow-limit": png_bomb(9000, 9000),
         "png-max": png_bomb(2**31 - 1, 2**31 - 1), "gif": gif_bomb(30000, 30000), "gif-max": gif_bomb(65535, 65535),
         "jpeg": jpeg_bomb(30000, 30000), "jpeg-max": jpeg_bomb(65535, 65535), "tiff": tiff_bomb(30000, 30000),
         "bmp": bmp_bomb(30000, 30000), "bmp-top-down": bmp_bomb(30000, -30000), "webp": webp_bomb()}


@pytest.mark.parametrize("name", list(BOMBS))
def test_decompression_bombs_refused_before_any_pixel(name: str) -> None:
    blob = BOMBS[name]
    assert len(blob) < 2048
    start = time.perf_counter()
    with address_space_cap(64 * MiB):  # a 30000x30000 RGB image would need 2.7 GB
        for max_source_pixels in (64_000_000, 1 << 20):
            with pytest.raises(MediaError) as info:
                open_image(blob, max_source_pixels)
            assert info.value.status == 413, info.value.message
            (out,) = decode_images([blob], "pil", "cpu", max_source_pixels=max_source_pixels)
            assert isinstance(out, MediaError) and out.status == 413
    assert time.perf_counter() - start < 1.0


def _zip(name: str, payload: bytes) -> bytes:
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(name, payload)
    return buf.getvalue()


HTML = b"<!doctype html><html><script>fetch('http://169.254.169.254/')</script></html>"
NOT_IMAGES = {
    "html": HTML, "svg": b'<svg xmlns="http://www.w3.org/2000/svg" width="30000" height="30000"/>',
    "eps": b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 30000 30000\nshowpage\n",  # never reaches ghostscript
    "pdf": b"%PDF-1.4\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF", "zip-then-jpeg": _zip("a.txt", b"x") + VALID_IMAGES[4],
    "psd": b"8BPS\x00\x01" + b"\0" * 6 + struct.pack(">HIIHH", 3, 64, 64, 8, 3) + b"\0" * 64,
    "ico": b"\0\0\1\0\1\0\x10\x10\0\0\1\0\x20\0" + b"\0" * 64, "empty": b"",
}


@pytest.mark.parametrize("name", list(NOT_IMAGES))
def test_non_images_and_polyglots_are_415(name: str) -> None:
    (out,) = decode_images([NOT_IMAGES[name]], "pil")
    assert isinstance(out, MediaError) and out.status == 415, out


def test_jpeg_zip_polyglot_decodes_as_its_jpeg() -> None:
    """A JPEG with a ZIP appended (the classic polyglot) is a JPEG to an image decoder: decoded, nothing run."""
    (out,) = decode_images([VALID_IMAGES[4] + _zip("payload.html", HTML)], "pil")
    assert isinstance(out, torch.Tensor) and out.shape == (3, 24, 32)


def test_html_named_jpg_is_415(tmp_path) -> None:
    """The name says .jpg, the bytes are HTML: the fetch reads them, the decoder refuses them."""
    path = tmp_path / "photo.jpg"
    path.write_bytes(HTML)
    blob = fetch_media(str(path), FetchPolicy(allowed_local_dir=str(tmp_path)))
    (out,) = decode_images([blob], "pil")
    assert isinstance(out, MediaError) and out.status == 415
    for fn in (lambda: probe_video(blob, deadline_s=5.0), lambda: decode_audio(blob)):
        with pytest.raises(MediaError) as info:
            fn()
        assert_4xx(info.value)


# ------------------------------------------------------------------------------------------------------ video

VIDEO = make_video(num_frames=8, fps=4, width=32, height=24, gop=4)
VIDEO_SPEC = VideoRead(VideoSampling(nframes=4), num_threads=2, deadline_s=5.0)
VIDEO_MAGIC = [b"\x00\x00\x00\x18ftypisom", b"\x1aE\xdf\xa3", b"RIFF\x00\x00\x00\x00AVI ", b"OggS", b"FLV\x01",
               b"\x00\x00\x01\xba", b"G", b""]


def check_video(blob: bytes) -> None:
    """`read_video` returns sampled frames of the container's size, or raises a 4xx MediaError, in time."""
    start = time.perf_counter()
    out = media_outcome(read_video, blob, VIDEO_SPEC)
    assert time.perf_counter() - start < VIDEO_SPEC.deadline_s + 2.0
    if not isinstance(out, MediaError):
        assert out.frames.dtype == torch.uint8 and out.frames.ndim == 4 and out.frames.shape[0] == 4
        assert np.isfinite(out.fps) and out.fps > 0 and out.source_frames >= 1


@SLOW_FUZZ
@given(st.sampled_from(VIDEO_MAGIC), st.binary(max_size=512))
def test_video_random_bytes(magic: bytes, tail: bytes) -> None:
    check_video(magic + tail)


@SLOW_FUZZ
@given(st.data())
def test_video_mutations(data: st.DataObject) -> None:
    check_video(mutate(data, VIDEO))


# (box, offset of a 32-bit field from the box type): sizes, durations, time scales, sample-table counts
MP4_FIELDS = {"tkhd.width": (b"tkhd", 80), "tkhd.height": (b"tkhd", 84), "avc1.width": (b"avc1", 28),
              "mvhd.timescale": (b"mvhd", 16), "mvhd.duration": (b"mvhd", 20), "mdhd.timescale": (b"mdhd", 16),
              "mdhd.duration": (b"mdhd", 20), "stts.entries": (b"stts", 8), "stts.count": (b"stts", 12),
              "stts.delta": (b"stts", 16), "stsz.size": (b"stsz", 8), "stsz.count": (b"stsz", 12),
              "stsc.entries": (b"stsc", 8), "stco.entries": (b"stco", 8), "stss.entries": (b"stss", 8)}
ABSURD = [0, 1, 7, 0xFFFF, 100_000, 10**7, 10**8, 2**30, 2**31 - 1, 2**31, 2**32 - 1]


def patch_mp4(blob: bytes, field: str, value: int) -> bytes:
    box, offset = MP4_FIELDS[field]
    out = bytearray(blob)
    at = out.index(box, out.index(b"moov")) + offset
    if field == "avc1.width":  # a 16-bit width, then the height
        struct.pack_into(">HH", out, at, value & 0xFFFF, value & 0xFFFF)
    else:
        struct.pack_into(">I", out, at, value)
    return bytes(out)


@SLOW_FUZZ
@given(st.sampled_from(list(MP4_FIELDS)), st.sampled_from(ABSURD) | st.integers(0, 2**32 - 1))
def test_mp4_absurd_header_fields(field: str, value: int) -> None:
    check_video(patch_mp4(VIDEO, field, value))


@pytest.mark.parametrize("field", ["tkhd.width", "tkhd.height", "avc1.width"])
def test_container_dimensions_are_not_trusted(field: str) -> None:
    """A container claiming 65535x65535 frames: the decoder's size (the bitstream's) is what counts."""
    out = read_video(patch_mp4(VIDEO, field, 0xFFFF0000 if field.startswith("tkhd") else 0xFFFF), VIDEO_SPEC)
    assert out.frames.shape == (4, 24, 32, 3)
    with pytest.raises(MediaError) as info:  # and the pixel limit applies to that size
        read_video(patch_mp4(VIDEO, field, 0xFFFF), VideoRead(VideoSampling(nframes=4), max_frame_pixels=32 * 23))
    assert info.value.status == 413


@pytest.mark.parametrize(("field", "value"), [("stts.count", 2**30), ("stts.count", 2**32 - 1), ("stts.entries", 9),
                                              ("stsz.size", 10**7), ("stsz.size", 10**8)])
def test_mp4_tables_that_killed_decord_are_415(field: str, value: int) -> None:
    """decord aborted (std::bad_alloc) or segfaulted on these 2 KB files, taking the whole process down.
    (9 stts entries where there is 1: FFmpeg reads the next boxes' bytes as frame counts.)"""
    with pytest.raises(MediaError) as info:
        probe_video(patch_mp4(VIDEO, field, value), deadline_s=5.0)
    assert info.value.status == 415 and "claims" in info.value.message


@pytest.mark.parametrize(("spec", "status", "code"), [
    (VideoRead(VideoSampling(nframes=4), max_frame_pixels=32 * 24 - 1), 413, "media_too_large"),
    (VideoRead(VideoSampling(nframes=4), max_frame_bytes=4 * 32 * 24 * 3 - 1), 413, "media_too_large"),
    (VideoRead(VideoSampling(nframes=4), max_duration_s=1.0), 413, "media_too_large"),
    (VideoRead(VideoSampling(nframes=10**6)), 400, "bad_video_frames"),  # more frames than the video has
    (VideoRead(VideoSampling(fps=1e9, max_frames=10**9)), 200, None),  # capped by the frames the video has
    (VideoRead(VideoSampling(fps=1e-9)), 200, None),  # at least min_frames
    (VideoRead(VideoSampling(video_start=1e300, video_end=2e300)), 400, "bad_video_range"),
])
def test_video_limits_and_absurd_sampling(spec: VideoRead, status: int, code: str | None) -> None:
    out = media_outcome(read_video, VIDEO, spec)
    if status == 200:
        assert not isinstance(out, MediaError) and out.frames.shape[1:] == (24, 32, 3)
    else:
        assert isinstance(out, MediaError) and (out.status, out.code) == (status, code), out


def test_video_absurd_fps_in_the_container() -> None:
    """A time scale of 1 (a frame every 512 s) is refused as too long; 2**32-1 (fps ~ 8e6) still samples."""
    slow = patch_mp4(VIDEO, "mdhd.timescale", 1)
    with pytest.raises(MediaError) as info:
        read_video(patch_mp4(slow, "mvhd.timescale", 1), VideoRead(VideoSampling(nframes=2), max_duration_s=3600))
    assert info.value.status in (400, 413)
    check_video(patch_mp4(VIDEO, "stts.delta", 1))


# ------------------------------------------------------------------------------------------------------ audio


def wav(rate: int = 16000, num_channels: int = 1, bits: int = 16, tag: int = 1, payload: bytes | None = None,
        data_size: int | None = None, block_align: int | None = None, fmt_size: int = 16) -> bytes:
    """A WAV whose header fields may all lie; `payload` defaults to 0.1 s of a ramp."""
    payload = bytes(range(256)) * 12 if payload is None else payload
    align = (num_channels * bits // 8) & 0xFFFF if block_align is None else block_align
    fmt = struct.pack("<HHIIHH", tag, num_channels, rate, (rate * align) & 0xFFFFFFFF, align, bits)
    fmt += b"\0" * (fmt_size - 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", fmt_size) + fmt + b"data"
    body += struct.pack("<I", len(payload) if data_size is None else data_size) + payload
    return b"RIFF" + struct.pack("<I", len(body) & 0xFFFFFFFF) + body


def _utf8_number(n: int) -> bytes:  # FLAC frame numbers are UTF-8 coded
    return chr(n).encode("utf-8", "surrogatepass")


def _crc(data: bytes, poly: int, bits: int) -> int:
    crc, top, mask = 0, 1 << (bits - 1), (1 << bits) - 1
    for byte in data:
        crc ^= byte << (bits - 8)
        for _ in range(8):
            crc = ((crc << 1) ^ poly) & mask if crc & top else (crc << 1) & mask
    return crc


def flac_bomb(num_frames: int, rate: int = 16000, declared_samples: int = 16000) -> bytes:
    """STREAMINFO claims 1 s; then `num_frames` 12-byte CONSTANT frames of 65535 samples each (~1e4 : 1)."""
    info = struct.pack(">HH", 65535, 65535) + b"\0" * 6
    info += ((rate << 44) | (15 << 36) | declared_samples).to_bytes(8, "big") + b"\0" * 16
    out = [b"fLaC\x80" + len(info).to_bytes(3, "big") + info]
    for i in range(num_frames):
        header = b"\xff\xf8\x70\x08" + _utf8_number(i) + struct.pack(">H", 65534)
        frame = header + bytes([_crc(header, 0x07, 8)]) + b"\x00\x00\x01"  # one CONSTANT subframe
        out.append(frame + struct.pack(">H", _crc(frame, 0x8005, 16)))
    return b"".join(out)


def mp3_bomb(num_frames: int) -> bytes:
    """MPEG-2 Layer III frames at 8 kbit/s, 24 kHz: 24 bytes each, 576 samples each (24 samples a byte)."""
    frame = b"\xff\xf3\x14\xc4" + b"\0" * 20  # sync, MPEG-2 L3 no CRC; bitrate 8k, 24 kHz; mono
    return frame * num_frames


def _valid_audio() -> list[bytes]:
    import av

    tone = (0.3 * np.sin(np.arange(8000) * 0.1)).astype(np.float32)
    pcm16 = (tone * 32767).astype("<i2").tobytes()
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp3") as out:
        stream = out.add_stream("libmp3lame", rate=16000, layout="mono")
        for start in range(0, tone.size, 1152):
            frame = av.AudioFrame.from_ndarray(tone[None, start:start + 1152], format="fltp", layout="mono")
            frame.sample_rate = 16000
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return [wav(payload=pcm16), wav(44100, 2, 16, payload=pcm16), wav(8000, 1, 8, payload=pcm16[:4000]),
            wav(48000, 1, 32, 3, payload=tone.tobytes()), flac_bomb(2, declared_samples=2 * 65535), buf.getvalue()]


VALID_AUDIO = _valid_audio()
AUDIO_MAGIC = [b"RIFF\x00\x00\x00\x00WAVE", b"RIFF\x00\x00\x00\x00WAVEfmt ", b"fLaC", b"fLaC\x00\x00\x00\x22",
               b"ID3\x03\x00\x00\x00\x00\x00\x00", b"\xff\xfb", b"\xff\xf3", b""]


def check_audio(blob: bytes) -> None:
    """`decode_audio` gives a finite mono 16 kHz waveform or a 4xx MediaError, without a big allocation."""
    start = time.perf_counter()
    with address_space_cap(1024 * MiB):
        out = media_outcome(decode_audio, blob, 60.0)
    assert time.perf_counter() - start < 3.0
    if not isinstance(out, MediaError):
        assert out.waveform.dtype == torch.float32 and out.waveform.ndim == 1 and out.sample_rate == 16000
        assert torch.isfinite(out.waveform).all()


@FUZZ
@given(st.sampled_from(AUDIO_MAGIC), st.binary(max_size=512))
def test_audio_random_bytes(magic: bytes, tail: bytes) -> None:
    check_audio(magic + tail)


@FUZZ
@given(st.data())
def test_audio_mutations(data: st.DataObject) -> None:
    check_audio(mutate(data, data.draw(st.sampled_from(VALID_AUDIO))))


@FUZZ
@given(rate=st.sampled_from([0, 1, 3999, 4000, 11025, 16001, 320163, 383999, 384000, 384001, 2**31, 2**32 - 1]),
       num_channels=st.sampled_from([0, 1, 2, 3, 255, 65535]),
       bits=st.sampled_from([0, 1, 7, 8, 16, 24, 32, 64, 65535]),
       tag=st.sampled_from([0, 1, 2, 3, 0xFFFE, 0xFFFF]),
       data_size=st.sampled_from([None, 0, 1, 2**31, 2**32 - 1]),
       block_align=st.sampled_from([None, 0, 1, 3, 0xFFFF]), fmt_size=st.sampled_from([16, 18, 40]),
       payload_size=st.integers(0, 4096))
def test_wav_absurd_headers(rate: int, num_channels: int, bits: int, tag: int, data_size: int | None,
                            block_align: int | None, fmt_size: int, payload_size: int) -> None:
    check_audio(wav(rate, num_channels, bits, tag, (bytes(range(256)) * 16)[:payload_size], data_size,
                    block_align, fmt_size))


@pytest.mark.parametrize(("blob", "status"), [
    (wav(0), 400), (wav(1), 400), (wav(2**32 - 1), 400), (wav(384001), 400),
    (wav(num_channels=0), 415), (wav(num_channels=65535), 400),  # 65535 channels: not one whole frame of data
    (wav(bits=0), 415), (wav(bits=7), 415), (wav(bits=64), 415), (wav(tag=3, bits=16), 415),
    (wav(data_size=2**32 - 1), 200), (wav(data_size=2**31, payload=b""), 400),  # the claim is never allocated
    (wav(tag=0xFFFE, fmt_size=40)[:40], 415), (wav()[:20], 415),  # 'fmt ' cut short: was a struct.error (500)
])
def test_wav_header_cases(blob: bytes, status: int) -> None:
    with address_space_cap(256 * MiB):
        out = media_outcome(decode_audio, blob)
    assert (200 if not isinstance(out, MediaError) else out.status) == status, out


@pytest.mark.parametrize("rate", [383999, 320163, 4001, 44100])
def test_odd_sample_rates_resample_quickly(rate: int) -> None:
    """A rate coprime to 16 kHz needed a 16000-phase filter: 7 s and 1.5 GB for 1 s of audio before the fix."""
    blob = wav(rate, payload=np.zeros(rate, "<i2").tobytes())
    start = time.perf_counter()
    with address_space_cap(256 * MiB):
        audio = decode_audio(blob)
    assert time.perf_counter() - start < 1.5
    assert abs(audio.waveform.numel() - 16000) <= 16


@pytest.mark.parametrize(("name", "blob", "samples"), [
    ("flac", flac_bomb(20_000), 20_000 * 65535),  # 240 KB claiming 1 s, decoding to 2 hours (5 GB of float32)
    ("mp3", mp3_bomb(200_000), 200_000 * 576),  # 4.8 MB decoding to 80 minutes
])
def test_audio_decompression_bombs_refused_before_decoding(name: str, blob: bytes, samples: int) -> None:
    assert max_decoded_samples(blob, name) >= samples
    start = time.perf_counter()
    with address_space_cap(256 * MiB):
        with pytest.raises(MediaError) as info:
            decode_audio(blob, max_duration_s=3600.0)
    assert info.value.status == 413 and "at most" in info.value.message
    assert time.perf_counter() - start < 2.0


def test_small_flac_and_mp3_still_decode() -> None:
    """The frame-header bound does not refuse what fits: 2 s of FLAC frames, real MP3."""
    assert decode_audio(flac_bomb(2, declared_samples=2 * 65535)).waveform.numel() == 2 * 65535
    assert abs(decode_audio(VALID_AUDIO[-1]).duration_s - 0.5) < 0.1


def flac_streaminfo_mismatch() -> bytes:
    """Valid 16-bit frames behind a STREAMINFO that says 8 bits: FFmpeg refuses every frame and decord 0.6
    divides by the sample rate it never learnt (SIGFPE), killing the process that decodes it."""
    blob = bytearray(flac_bomb(2, declared_samples=2 * 65535))
    bits = int.from_bytes(blob[18:26], "big")
    blob[18:26] = ((bits & ~(31 << 36)) | (7 << 36)).to_bytes(8, "big")  # bits per sample - 1 = 7
    return bytes(blob)


def test_decoder_crash_is_contained_by_the_fetch_pool() -> None:
    """What decord still kills the process on is read in a fetch-pool child: the item fails with 415 (the
    pool replaces the child; test_fetch_pool covers the replacement)."""
    import threading

    from preprocess.fetch_pool import FetchPool, FetchTask
    from preprocess.media_read import AudioRead

    results: list = []
    done = threading.Semaphore(0)
    with FetchPool(1, FetchPolicy(), 1 << 20, item_timeout_s=30.0, name="mmenc-fuzz") as pool:
        pool.submit(FetchTask("data:", flac_streaminfo_mismatch(), audio=AudioRead()),
                    lambda result: (results.append(result), done.release()))
        assert done.acquire(timeout=60), "no answer"
    (crashed,) = results
    assert crashed.error is not None and crashed.error.status == 415 and "crashed" in crashed.error.message
