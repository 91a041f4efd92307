"""Video resize / normalize / patchify on the device; matches transformers' `Qwen2VLVideoProcessor`.

Sampling (which frames, what size) lives in `preprocess.video_sampling`, decoding in
`preprocess.video_decode`. Here: the sampled uint8 frames of one video go to the device, are resized in
one `tvF.resize` call (bicubic + antialias on uint8, as images), rescaled+normalized in one fused
multiply-add, padded to a multiple of `temporal_patch_size` by repeating the last frame, and patchified
into `[seq, C * tp * ps * ps]` rows ordered (t, merge window, row in window, column in window).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torchvision.transforms.v2 import functional as tvF

from preprocess.image import normalize_coeffs, to_device
from preprocess.video_sampling import VideoSampling, frame_size

if TYPE_CHECKING:
    from encoder_server.config import PreprocessConfig


@dataclass
class VideoPatches:
    """Patches of one video."""

    pixel_values: torch.Tensor  # [grid_t * grid_h * grid_w, C * temporal_patch * patch * patch], on the device
    grid_thw: torch.Tensor  # [3] int64 on the CPU: (grid_t, grid_h, grid_w)

    @property
    def seq_len(self) -> int:
        """Patches before the merger."""
        return int(self.grid_thw.prod())


def video_num_tokens(num_frames: int, height: int, width: int, cfg: PreprocessConfig, sampling: VideoSampling) -> int:
    """Embedding tokens a video of `num_frames` sampled frames of this source size yields after the merger."""
    h, w = frame_size(height, width, num_frames, sampling)
    grid_t = -(-num_frames // cfg.temporal_patch_size)
    return grid_t * (h // cfg.patch_size) * (w // cfg.patch_size) // cfg.merge_size**2


def preprocess_video(
    frames: torch.Tensor,
    cfg: PreprocessConfig,
    sampling: VideoSampling,
    device: torch.device | str,
    out_dtype: torch.dtype = torch.float32,
    channels_last: bool = False,
) -> VideoPatches:
    """Resize, rescale+normalize and patchify the sampled frames of one video on `device`.

    Args:
        frames: uint8 `[T, 3, H, W]` (or `[T, H, W, 3]` with `channels_last=True`, as decord returns).
        cfg: patch geometry and mean/std.
        sampling: the per-frame pixel budget (`frame_size`).
        device: where the work happens and where `pixel_values` ends up.
        out_dtype: dtype of `pixel_values` (normalization is computed in float32 first).
        channels_last: `frames` is `[T, H, W, 3]`.
    Returns:
        `VideoPatches` with `grid_thw = (ceil(T / tp), h / ps, w / ps)`.
    Raises:
        MediaError: the frame's aspect ratio is above 200.
    """
    if channels_last:
        frames = frames.permute(0, 3, 1, 2)  # [T, 3, H, W]
    if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[1] != 3 or frames.shape[0] < 1:
        raise ValueError(f"expected uint8 [T, 3, H, W] frames, got {frames.dtype} {tuple(frames.shape)}")
    device = torch.device(device)
    num_frames, _, height, width = frames.shape
    h, w = frame_size(height, width, num_frames, sampling)
    frames = to_device(frames.contiguous(), device)
    resized = tvF.resize(frames, [h, w], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)  # [T, 3, h, w]
    scale, bias = normalize_coeffs(cfg, device)  # [3, 1, 1] each
    normed = torch.addcmul(bias, resized, scale).to(out_dtype)  # [T, 3, h, w]
    pixel_values, grid_thw = patchify_video(normed, cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size)
    return VideoPatches(pixel_values, grid_thw)


def patchify_video(
    frames: torch.Tensor, patch_size: int, merge_size: int, temporal_patch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, C, h, w]` -> (`[grid_t * grid_h * grid_w, C * tp * ps * ps]`, grid_thw `[3]`), as transformers.

    NOTE: an odd frame count (T % tp != 0) is padded by repeating the last frame.
    """
    if pad := -frames.shape[0] % temporal_patch_size:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])  # [T + pad, C, h, w]
    t, c, h, w = frames.shape
    grid_t, grid_h, grid_w = t // temporal_patch_size, h // patch_size, w // patch_size
    patches = frames.reshape(grid_t, temporal_patch_size, c, grid_h // merge_size, merge_size, patch_size,
                             grid_w // merge_size, merge_size, patch_size)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [gt, gh/m, gw/m, m, m, C, tp, ps, ps]
    pixel_values = patches.reshape(grid_t * grid_h * grid_w, c * temporal_patch_size * patch_size * patch_size)
    return pixel_values, torch.tensor([grid_t, grid_h, grid_w], dtype=torch.int64)
