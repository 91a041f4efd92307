"""The `mmenc bench soak` plot, drawn with PIL (no matplotlib): memory per series over time above, queue depth
and items in flight below; the warm-up (t < 0) and the drain after the soak are shaded."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

WIDTH, HEIGHT = 960, 640
LEFT, RIGHT_LEGEND, TOP = 64, 230, 34  # plot margins; the legend sits right of the panels
PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f",
           "#bcbd22"]
Series = tuple[str, str, list[tuple[float, float]]]  # label, colour, (t, value) points


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: one bitmap size
        return ImageFont.load_default()


def _ticks(lo: float, hi: float, num: int = 5) -> list[float]:
    """Round tick values covering [lo, hi] (steps of 1, 2 or 5 x 10^k)."""
    span = max(hi - lo, 1e-9)
    raw = span / num
    base = 10 ** math.floor(math.log10(raw))
    step = next(m * base for m in (1, 2, 5, 10) if m * base >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _label(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 10 or value == int(value) else f"{value:.1f}"


def _panel(d: ImageDraw.ImageDraw, box: tuple[int, int, int, int], x_range: tuple[float, float],
           series: list[Series], y_label: str, shade: list[tuple[float, float]], font: Any) -> None:
    x0, y0, x1, y1 = box
    t_lo, t_hi = x_range
    y_hi = max((v for _, _, pts in series for _, v in pts), default=1.0) * 1.1 or 1.0

    def px(t: float, v: float) -> tuple[float, float]:
        return x0 + (t - t_lo) / (t_hi - t_lo) * (x1 - x0), y1 - v / y_hi * (y1 - y0)

    for a, b in shade:
        if b > a:
            d.rectangle([px(a, 0)[0], y0, px(b, 0)[0], y1], fill="#eeeeee")
    for v in _ticks(0, y_hi):
        y = px(t_lo, v)[1]
        d.line([x0, y, x1, y], fill="#dddddd")
        d.text((x0 - 6, y), _label(v), fill="black", font=font, anchor="rm")
    for t in _ticks(t_lo, t_hi, 8):
        x = px(t, 0)[0]
        d.line([x, y1, x, y1 + 4], fill="black")
        d.text((x, y1 + 6), _label(t), fill="black", font=font, anchor="mt")
    d.rectangle([x0, y0, x1, y1], outline="black")
    d.text((x0 + 4, y0 + 3), y_label, fill="black", font=font)
    for _, colour, pts in series:
        xy = [px(t, v) for t, v in pts]
        if len(xy) > 1:
            d.line(xy, fill=colour, width=2)
        for x, y in xy if len(xy) == 1 else []:
            d.ellipse([x - 2, y - 2, x + 2, y + 2], fill=colour)
    legend_x, legend_y = x1 + 14, y0 + 4
    for label, colour, _ in series:
        d.line([legend_x, legend_y + 7, legend_x + 18, legend_y + 7], fill=colour, width=3)
        d.text((legend_x + 24, legend_y), label, fill="black", font=font)
        legend_y += 17


def _change(pts: list[tuple[float, float]]) -> str:
    base = next((v for t, v in pts if t >= 0), pts[0][1])
    return f"{base:.0f} -> {pts[-1][1]:.0f} MiB"


def plot(samples: list[dict[str, Any]], path: Path, title: str, soak_end_t: float) -> Path:
    """Write the PNG to `path`. `samples` are the soak's (t, memory_mib, queue_depth, inflight_items) dicts."""
    img = Image.new("RGB", (WIDTH, HEIGHT), "white")
    d = ImageDraw.Draw(img)
    font = _font(12)
    d.text((LEFT, 10), title, fill="black", font=_font(14))
    ts = [s["t"] for s in samples] or [0.0, 1.0]
    x_range = (min(ts), max(max(ts), min(ts) + 1.0))
    shade = [(x_range[0], 0.0), (soak_end_t, x_range[1])]
    names = list(dict.fromkeys(k for s in samples for k in s["memory_mib"]))
    memory: list[Series] = []
    for i, name in enumerate(names):
        pts = [(s["t"], s["memory_mib"][name]) for s in samples if name in s["memory_mib"]]
        memory.append((f"{name} {_change(pts)}", PALETTE[i % len(PALETTE)], pts))
    queue: list[Series] = []
    for key, label, colour in (("queue_depth", "queue depth", "#d62728"), ("inflight_items", "items in flight",
                                                                            "#1f77b4")):
        pts = [(s["t"], float(s[key])) for s in samples if s.get(key) is not None]
        if pts:
            queue.append((f"{label} (max {max(v for _, v in pts):.0f})", colour, pts))
    right = WIDTH - RIGHT_LEGEND
    split = TOP + int((HEIGHT - TOP - 46) * 0.62)
    _panel(d, (LEFT, TOP, right, split - 12), x_range, memory, "memory, MiB", shade, font)
    _panel(d, (LEFT, split + 12, right, HEIGHT - 46), x_range, queue, "items", shade, font)
    caption = "seconds since the soak started (shaded: warm-up, drain); legend: MiB at t = 0 -> last"
    d.text(((LEFT + right) / 2, HEIGHT - 14), caption, fill="black", font=font, anchor="mm")
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path
