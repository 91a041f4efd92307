"""Memory probes of `mmenc bench soak`: RSS per server process (less shared-memory pages), the /dev/shm
segments they map, and GPU memory, with the processes found from `/health`'s pids."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any


def _rss_mib(pid: int) -> float | None:
    """Resident set of `pid` in MiB less its touched /dev/shm pages (RssShmem: the cache and fetch arenas,
    counted once in the `shm` series); psutil if installed, else /proc. None once the process is gone."""
    fields: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    try:
        import psutil

        fields["VmRSS"] = psutil.Process(pid).memory_info().rss
    except ImportError:
        pass
    except Exception:  # psutil.NoSuchProcess / AccessDenied
        return None
    return (fields["VmRSS"] - fields.get("RssShmem", 0)) / 2**20 if "VmRSS" in fields else None


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


def _proc_field(pid: int, name: str) -> str:
    try:
        return Path(f"/proc/{pid}/{name}").read_text().strip()
    except OSError:
        return ""


def _shm_mib(pids: list[int]) -> dict[str, float]:
    """/dev/shm segments mapped by `pids` (cache arenas, fetch arenas): allocated MiB of the live ones, and
    the mapped size of unlinked-but-still-mapped ones (`shm_deleted`: memory nobody can free by name)."""
    live: set[str] = set()
    deleted: dict[str, int] = {}
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            if "/dev/shm/" not in line:
                continue
            path = line[line.index("/dev/shm/"):]
            if path.endswith(" (deleted)"):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                deleted[path] = max(deleted.get(path, 0), hi - lo)
            else:
                live.add(path)
    total = 0
    for path in live:
        try:
            total += Path(path).stat().st_blocks * 512
        except OSError:
            continue
    return {"shm": total / 2**20, **({"shm_deleted": sum(deleted.values()) / 2**20} if deleted else {})}


def _gpu_mib() -> float | None:
    """Memory used on all GPUs (nvidia-smi; whole device, not per process); None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return float(sum(float(x) for x in out.split()))
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


class MemoryProbe:
    """RSS per server process, /dev/shm and GPU memory (MiB), the processes found from `/health`'s pids.

    Args:
        server_pid: the `mmenc serve` process when started here; else the workers' parent is the gateway.
    """

    def __init__(self, server_pid: int | None) -> None:
        self.server_pid = server_pid
        self.has_gpu = _gpu_mib() is not None

    def sample(self, health: dict[str, Any]) -> dict[str, Any]:
        memory: dict[str, float | None] = {}
        workers = [(i, w.get("pid")) for i, w in enumerate(health.get("workers", []))]
        tree: list[int] = []
        gateway = self.server_pid or next((int(_proc_field(p, "stat").rsplit(")", 1)[-1].split()[1])
                                           for _, p in workers if p and _proc_field(p, "stat")), None)
        if gateway:
            memory["gateway"] = _rss_mib(gateway)
            stack = [gateway]
            while stack:  # every descendant: workers, fetch processes, engine, resource trackers
                tree.append(pid := stack.pop())
                stack += _children(pid)
            memory["total_rss"] = sum(_rss_mib(p) or 0.0 for p in tree)
        for i, pid in workers:
            if not pid:
                continue
            memory[f"worker{i}"] = _rss_mib(pid)
            fetch = [c for c in _children(pid) if _proc_field(c, "comm").startswith("mmenc-fetch")]
            memory[f"worker{i}.fetch"] = sum(_rss_mib(c) or 0.0 for c in fetch)
        if (engine := (health.get("engine") or {}).get("pid")) is not None:
            memory["engine"] = _rss_mib(engine)
        memory.update(_shm_mib(tree))
        if self.has_gpu:
            memory["gpu"] = _gpu_mib()
        return {"memory_mib": {k: round(v, 2) for k, v in memory.items() if v is not None}}
