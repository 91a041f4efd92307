"""Small test videos made with PyAV (H.264 in MP4), no ffmpeg binary needed."""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np


def make_video(num_frames: int = 48, fps: int = 24, width: int = 64, height: int = 48, gop: int = 12,
               codec: str = "libx264", container: str = "mp4") -> bytes:
    """Encode a video whose every frame differs (moving gradient + frame-number bars); returns the file bytes."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.gop_size = gop
        stream.codec_context.time_base = Fraction(1, fps)
        if codec == "libx264":
            stream.options = {"bf": "0", "sc_threshold": "0", "keyint_min": str(gop)}
        yy, xx = np.mgrid[0:height, 0:width]
        for i in range(num_frames):
            rgb = np.empty((height, width, 3), dtype=np.uint8)
            rgb[..., 0] = (xx * 4 + i * 5) % 256
            rgb[..., 1] = (yy * 4 + i * 3) % 256
            rgb[..., 2] = ((xx + yy) * 2 + i * 7) % 256
            rgb[: height // 4, : (i % width) + 1] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()
