"""Shared benchmark plumbing: timing with warm-up and medians, environment facts, JSON + markdown output."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_median(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int,
                max_seconds: float = 20.0) -> float:
    """Median seconds per call of `fn` after `warmup` calls; stops early after `max_seconds` of timing."""
    for _ in range(warmup):
        fn()
    sync(device)
    times: list[float] = []
    budget_end = time.perf_counter() + max_seconds
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
        if time.perf_counter() > budget_end and len(times) >= 3:
            break
    return statistics.median(times)


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "device": str(device), "cpu_count": torch.get_num_threads()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def write_results(name: str, out_dir: str, payload: dict[str, Any]) -> Path:
    path = Path(out_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    return path


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [f"{row[c]:.3g}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
