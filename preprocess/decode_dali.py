"""The `dali` decode backend: JPEGs through an NVIDIA DALI pipeline, everything else through PIL.

Imported only when the backend is chosen (`preprocess.decode` registry), so DALI stays optional.

- Without CUDA the pipeline is CPU-only (`device_id=None`, `decoders.image(device="cpu")`); on a GPU
  it is `device="mixed"` (nvJPEG, output on the GPU). One pipeline per device, built once and fed in
  chunks of `MAX_BATCH_SIZE` through `fn.external_source`.
- DALI applies EXIF orientation for JPEGs (checked against Pillow's `exif_transpose` for all eight
  orientations) and its CPU decoder is libjpeg-turbo, so on the CPU it is bit-identical to PIL.
- Only JPEGs that pass `is_plain_jpeg` go to DALI (8-bit modes; sound marker structure ending in
  EOI, since nvJPEG in the `mixed` decoder neither notices truncation nor survives every malformed
  file); DALI drops alpha instead of compositing it on white and scales 16-bit data its own way, so
  PNG & co. take the PIL path.
- A corrupt image fails DALI's whole batch and leaves the pipeline unusable: the pipeline is rebuilt
  and the chunk retried item by item; an item DALI still refuses goes to PIL, which either decodes it
  or names what is wrong with it.
"""

from __future__ import annotations

import functools
import os
import threading

import numpy as np
import torch
from nvidia.dali import fn, pipeline_def, types

from preprocess.decode import DecodeResult, decode_one_pil, is_plain_jpeg, open_image, to_device
from preprocess.errors import MediaError

MAX_BATCH_SIZE = 64
_CPU_MODES = ("RGB", "L", "CMYK", "YCbCr")  # bit-identical to PIL through libjpeg-turbo (tested)
_GPU_MODES = ("RGB", "L")  # as the nvjpeg backend: CMYK through nvJPEG is not checked against PIL


class DaliDecoder:
    """One DALI decode pipeline for one device; rebuilt after a failed run. Thread-safe."""

    def __init__(self, device_id: int | None) -> None:
        self.device_id = device_id
        self._lock = threading.Lock()
        self._pipe = self._build()

    def _build(self):  # -> nvidia.dali.Pipeline
        decoder_device = "cpu" if self.device_id is None else "mixed"

        @pipeline_def(batch_size=MAX_BATCH_SIZE, num_threads=min(4, os.cpu_count() or 1),
                      device_id=self.device_id, prefetch_queue_depth=1)
        def pipeline():
            encoded = fn.external_source(name="encoded", dtype=types.UINT8)
            return fn.decoders.image(encoded, device=decoder_device, output_type=types.RGB)

        pipe = pipeline()
        pipe.build()
        return pipe

    def decode(self, blobs: list[bytes]) -> list[torch.Tensor]:
        """Decode up to `MAX_BATCH_SIZE` JPEGs to uint8 `[3, H, W]`; raises if any item fails."""
        assert 0 < len(blobs) <= MAX_BATCH_SIZE
        with self._lock:
            try:
                self._pipe.feed_input("encoded", [np.frombuffer(b, dtype=np.uint8) for b in blobs])
                (out,) = self._pipe.run()
                # NOTE: DALI reuses its output buffers on the next run, so every image is copied out.
                if self.device_id is None:
                    images = [torch.from_numpy(np.array(out[i])) for i in range(len(blobs))]  # [H, W, 3]
                else:
                    images = [torch.from_dlpack(out[i]).clone() for i in range(len(blobs))]  # [H, W, 3]
            except RuntimeError:
                self._pipe = self._build()  # a failed pipeline is no longer valid
                raise
        return [image.permute(2, 0, 1) for image in images]  # [3, H, W] each


@functools.cache
def get_decoder(device_id: int | None) -> DaliDecoder:
    """The process-wide DALI decoder for a CUDA device index (None: CPU only)."""
    return DaliDecoder(device_id)


def decode_dali(blobs: list[bytes], device: torch.device, max_source_pixels: int) -> list[DecodeResult]:
    """The `dali` backend (see the module docstring). Output on `device` (CPU or CUDA)."""
    device_id = None if device.type != "cuda" else (device.index or 0)
    if device_id is not None:
        device = torch.device("cuda", device_id)
    modes = _CPU_MODES if device_id is None else _GPU_MODES
    results: list[DecodeResult | None] = [None] * len(blobs)
    dali_items: list[int] = []
    for i, blob in enumerate(blobs):
        try:
            img = open_image(blob, max_source_pixels)
        except MediaError as e:
            results[i] = e
            continue
        if is_plain_jpeg(blob, img, modes):
            dali_items.append(i)
        else:
            results[i] = to_device(decode_one_pil(blob, max_source_pixels), device)

    if not dali_items:
        return results  # type: ignore[return-value]
    decoder = get_decoder(device_id)
    for start in range(0, len(dali_items), MAX_BATCH_SIZE):
        chunk = dali_items[start:start + MAX_BATCH_SIZE]
        try:
            for i, image in zip(chunk, decoder.decode([blobs[i] for i in chunk]), strict=True):
                results[i] = image
        except RuntimeError:  # one bad item fails the whole batch: isolate it
            for i in chunk:
                try:
                    results[i] = decoder.decode([blobs[i]])[0]
                except RuntimeError:
                    results[i] = to_device(decode_one_pil(blobs[i], max_source_pixels), device)
    return results  # type: ignore[return-value]

