"""Index layout of a packed batch of images for the Qwen2.5-VL ViT, computed once per forward on the host.

Everything here depends only on the grids (t, h, w), not on pixels: rotary positions, the window
permutation (tokens of one 112px window made contiguous), the segment boundaries of windowed and full
attention, and the inverse permutation for the merged output. Per-grid pieces are cached, so a batch of
images with known sizes costs a few concatenations, never a Python loop over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from encoder_server.models.attention import Segments

Grid = tuple[int, int, int]


@dataclass(frozen=True)
class GridLayout:
    """Layout of one (t, h, w) grid, token offsets starting at 0."""

    positions: np.ndarray  # [t*h*w, 2] (row, col) of each patch, in window order
    unit_order: np.ndarray  # [t*h*w / merge_unit] merge-unit index in window order
    window_lengths: tuple[int, ...]  # tokens per window, window order
    frame_tokens: int  # h * w: one full-attention segment per frame


@lru_cache(maxsize=4096)
def grid_layout(grid: Grid, merge: int, window_units: int) -> GridLayout:
    """Layout of one grid. `window_units` is the window side in merged units (window_size // merge // patch)."""
    t, h, w = grid
    lh, lw = h // merge, w // merge
    # (row, col) of each patch in merge-block order: blocks row-major, patches row-major inside a block.
    rows = np.arange(h).reshape(lh, merge, 1, 1).repeat(lw, 2).repeat(merge, 3)  # [lh, m, lw, m]
    cols = np.arange(w).reshape(1, 1, lw, merge).repeat(lh, 0).repeat(merge, 1)  # [lh, m, lw, m]
    block_rows = rows.transpose(0, 2, 1, 3).reshape(-1)  # [h*w]
    block_cols = cols.transpose(0, 2, 1, 3).reshape(-1)  # [h*w]
    positions = np.tile(np.stack([block_rows, block_cols], axis=-1), (t, 1))  # [t*h*w, 2]

    # Windows of window_units x window_units merge units, padded at the bottom/right edges.
    pad_h, pad_w = -lh % window_units, -lw % window_units
    units = np.arange(t * lh * lw).reshape(t, lh, lw)
    padded = np.pad(units, ((0, 0), (0, pad_h), (0, pad_w)), constant_values=-1)
    nwh, nww = (lh + pad_h) // window_units, (lw + pad_w) // window_units
    windows = padded.reshape(t, nwh, window_units, nww, window_units).transpose(0, 1, 3, 2, 4)
    windows = windows.reshape(t * nwh * nww, window_units * window_units)  # [num_windows, units]
    valid = windows >= 0
    unit_order = windows[valid]  # [t*lh*lw]
    lengths = valid.sum(1) * merge * merge
    unit = merge * merge
    token_order = (unit_order[:, None] * unit + np.arange(unit)).reshape(-1)
    return GridLayout(
        positions=positions[token_order],
        unit_order=unit_order,
        window_lengths=tuple(int(n) for n in lengths if n > 0),
        frame_tokens=h * w,
    )


@dataclass(frozen=True)
class PackedLayout:
    """Layout of a whole packed batch, tensors on the compute device."""

    token_order: torch.Tensor  # [T] patch index in window order (gather from patchify order)
    positions: torch.Tensor  # [T, 2] rotary (row, col), window order
    output_order: torch.Tensor  # [T / merge_unit] gather that restores patchify order after the merger
    full: Segments  # one segment per frame
    windowed: Segments  # one segment per window
    merged_lengths: tuple[int, ...]  # output tokens per item


def build_layout(grids: list[Grid], merge: int, window_units: int, device: torch.device,
                 with_groups: bool) -> PackedLayout:
    """Concatenate per-grid layouts with offsets; one host->device copy per tensor."""
    unit = merge * merge
    positions, unit_orders = [], []
    full_lengths: list[int] = []
    window_lengths: list[int] = []
    token_offset = 0
    for grid in grids:
        g = grid_layout(tuple(int(x) for x in grid), merge, window_units)
        num_tokens = g.positions.shape[0]
        unit_orders.append(g.unit_order + token_offset // unit)
        positions.append(g.positions)
        full_lengths += [g.frame_tokens] * grid[0]
        window_lengths += g.window_lengths
        token_offset += num_tokens
    unit_order = np.concatenate(unit_orders)  # [T / unit]
    token_order = (unit_order[:, None] * unit + np.arange(unit)).reshape(-1)  # [T]
    output_order = np.argsort(unit_order, kind="stable")  # [T / unit]

    def to_device(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
        return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t

    return PackedLayout(
        token_order=to_device(token_order),
        positions=to_device(np.concatenate(positions)),
        output_order=to_device(output_order),
        full=Segments.from_lengths(full_lengths, device, with_groups),
        windowed=Segments.from_lengths(window_lengths, device, with_groups),
        merged_lengths=tuple(int(t) * int(h) * int(w) // unit for t, h, w in grids),
    )
