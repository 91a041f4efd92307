"""`python -m bench.cache_shm`: latency and bandwidth of the machine-wide shared-memory embedding cache.

For each embedding size and process count, one arena holds `num_keys` pre-put embeddings; every process
attaches, touches each key once (page-table warm-up), waits at a barrier, then hammers `get` on random keys
for `seconds`, then `put` (overwriting the same keys) for `seconds`. Reports p50 latency and GB/s per process
(payload bytes / wall time) plus the sum over processes, next to the copy a get cannot avoid, measured in
the same run: allocate a tensor and copy into it from private buffers with the same working set
(`memcpy_*`). `get_overhead_us` = get p50 - memcpy p50: the cost of the lookup, locking and validation.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from typing import Any

import numpy as np
import torch

from bench.common import markdown_table, write_results
from cache.shm import ShmEmbeddingCache
from cache.shm_layout import block_bytes

DEFAULT_SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
COLUMNS = ["size_kib", "procs", "get_p50_us", "get_gbps_proc", "get_gbps_sum", "get_overhead_us", "put_p50_us",
           "put_gbps_proc", "put_gbps_sum", "memcpy_p50_us", "memcpy_gbps"]


def _num_keys(size: int) -> int:
    return max(4, min(32, (256 << 20) // size))  # at most ~256 MiB of arena per size


def _hammer(name: str, op: str, size: int, seed: int, seconds: float, barrier: Barrier, conn: Connection) -> None:
    """One benchmark process: warm up, wait for the others, then time `op` on random keys."""
    torch.set_num_threads(1)
    cache = ShmEmbeddingCache(name, 0, create=False, lock_timeout_s=30.0)  # measure waits, not timeouts
    rng = random.Random(seed)
    keys = [f"{i:064x}" for i in range(_num_keys(size))]
    value = torch.randn(size // 4)  # [size / 4] float32
    for key in keys:  # warm-up: map the arena's pages into this process
        if op == "get":
            assert cache.get(key) is not None
        else:
            cache.put(key, value)
    barrier.wait(timeout=120)
    latencies: list[float] = []
    start = time.perf_counter()
    deadline = start + seconds
    while (now := time.perf_counter()) < deadline:
        key = keys[rng.randrange(len(keys))]
        ok = cache.get(key) is not None if op == "get" else cache.put(key, value)
        latencies.append(time.perf_counter() - now)
        assert ok, f"{op} failed"
    conn.send((statistics.median(latencies), len(latencies), time.perf_counter() - start))  # small: fits the pipe
    cache.close()


def _copy_p50(size: int, iters: int = 200) -> float:
    """p50 seconds of what a get cannot avoid: allocate a tensor and copy `size` bytes into it from one of
    `_num_keys(size)` private buffers picked at random (the same working set as the arena's keys)."""
    rng = random.Random(0)
    sources = [np.full(size, i, dtype=np.uint8) for i in range(_num_keys(size))]
    times = []
    for _ in range(iters):
        src = sources[rng.randrange(len(sources))]
        start = time.perf_counter()
        torch.empty(size, dtype=torch.uint8).numpy()[:] = src
        times.append(time.perf_counter() - start)
    return statistics.median(times[iters // 10:])


def _run_op(ctx: mp.context.BaseContext, name: str, op: str, size: int, procs: int, seconds: float
            ) -> tuple[float, list[float]]:
    """(median over processes of their p50 seconds per call, GB/s of each process)."""
    barrier = ctx.Barrier(procs)
    pipes = [ctx.Pipe(duplex=False) for _ in range(procs)]
    workers = [ctx.Process(target=_hammer, args=(name, op, size, rank, seconds, barrier, send))
               for rank, (_, send) in enumerate(pipes)]
    for w in workers:
        w.start()
    for w in workers:  # NOTE: results are small; a dead worker must not leave us blocked on its pipe
        w.join(seconds + 120)
        if w.exitcode != 0:
            for other in workers:
                other.kill()
            raise RuntimeError(f"benchmark process for {op} exited with {w.exitcode}")
    results = [recv.recv() for recv, _ in pipes]
    return statistics.median(p50 for p50, _, _ in results), [n * size / elapsed / 1e9 for _, n, elapsed in results]


def run_shm_bench(sizes_bytes: list[int], num_procs: list[int], seconds: float) -> list[dict[str, Any]]:
    """One row per (size, process count): get and put p50 latency and GB/s, next to a memcpy baseline.

    Args:
        sizes_bytes: embedding sizes (multiples of 4: stored as float32).
        num_procs: process counts; every process hammers the same arena.
        seconds: timed seconds per operation (get, then put) and configuration.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "cache.shm"])
    rows: list[dict[str, Any]] = []
    for size in sizes_bytes:
        memcpy_s = _copy_p50(size)
        for procs in num_procs:
            name = f"mmenc-bench-{os.getpid()}-{size}-{procs}"
            cache = ShmEmbeddingCache(name, _num_keys(size) * block_bytes(size) + (1 << 20))
            try:
                value = torch.randn(size // 4, generator=torch.Generator().manual_seed(0))
                for i in range(_num_keys(size)):
                    assert cache.put(f"{i:064x}", value)
                get_s, get_gbps = _run_op(ctx, name, "get", size, procs, seconds)
                put_s, put_gbps = _run_op(ctx, name, "put", size, procs, seconds)
                stats = cache.stats()
            finally:
                cache.close()
                cache.unlink()
            rows.append({
                "size_kib": size // 1024, "procs": procs,
                "get_p50_us": get_s * 1e6, "get_gbps_proc": statistics.mean(get_gbps), "get_gbps_sum": sum(get_gbps),
                "get_overhead_us": (get_s - memcpy_s) * 1e6,
                "put_p50_us": put_s * 1e6, "put_gbps_proc": statistics.mean(put_gbps), "put_gbps_sum": sum(put_gbps),
                "memcpy_p50_us": memcpy_s * 1e6, "memcpy_gbps": size / memcpy_s / 1e9,
                "read_retries": stats["read_retries"], "lock_timeouts": stats["lock_timeouts"],
            })
            print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cache_shm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-kib", default=",".join(str(s >> 10) for s in DEFAULT_SIZES))
    p.add_argument("--procs", default="1,8", help="comma list of process counts")
    p.add_argument("--seconds", type=float, default=1.0, help="timed seconds per operation and configuration")
    p.add_argument("--out-dir", default=None, help="also write <out-dir>/<name>.json")
    p.add_argument("--name", default="cache_shm")
    a = p.parse_args(argv)
    sizes = [int(s) << 10 for s in a.sizes_kib.split(",")]
    procs = [int(n) for n in a.procs.split(",")]
    rows = run_shm_bench(sizes, procs, a.seconds)
    env = {"cpu_count": os.cpu_count(), "torch": torch.__version__, "python": sys.version.split()[0]}
    print(markdown_table(rows, COLUMNS))
    if a.out_dir:
        print(f"results: {write_results(a.name, a.out_dir, {'env': env, 'args': vars(a), 'rows': rows})}")
    one = [r for r in rows if r["procs"] == 1 and r["size_kib"] == 1024] or rows[:1]
    if one:
        r = one[0]
        print(f"SUMMARY cache_shm {r['size_kib']} KiB, 1 process: get p50 {r['get_p50_us']:.0f} us "
              f"({r['get_overhead_us']:.0f} us over memcpy), {r['get_gbps_proc']:.1f} GB/s "
              f"(memcpy {r['memcpy_gbps']:.1f} GB/s); put p50 {r['put_p50_us']:.0f} us; {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
