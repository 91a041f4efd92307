"""`mmenc bench cache`: how much routing by consistent hashing buys the embedding cache (CPU only).

1. Cache-hit simulation (`bench.cache_sim`): Zipf(s) requests over a media catalogue, E encoders with an
   LRU of C items each, C swept so that E x C holds 1..20% of the distinct media. Hit rate of round-robin,
   random, consistent hashing (our `Ring` on the URL's route key), consistent hashing + a machine-wide
   shared cache, and one ideal shared LRU of E x C. Targets: consistent / round-robin >= 1.3 and within
   2 points of ideal at the headline capacity.
2. Ring churn: share of keys that move when one encoder leaves or joins (<= 1/E + 2%).
3. The shared-memory cache micro-benchmark (`bench.cache_shm`), when that module is present.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from importlib import metadata
from typing import Any

import numpy as np

from bench.cache_sim import POLICIES, Workload, hit_rate_sweep, ring_churn
from bench.common import markdown_table, write_results

TARGET_CH_VS_RR = 1.3
TARGET_IDEAL_GAP_PTS = 2.0


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _environment() -> dict[str, Any]:
    return {"python": platform.python_version(), "numpy": np.__version__, "uhashring": metadata.version("uhashring"),
            "cpu_count": os.cpu_count(), "machine": platform.machine()}


def _shm_section(a: argparse.Namespace) -> dict[str, Any]:
    """Rows of `bench.cache_shm.run_shm_bench`, or a note saying why there are none."""
    if a.skip_shm:
        return {"note": "skipped (--skip-shm)", "rows": []}
    try:
        from bench.cache_shm import run_shm_bench
    except ImportError as e:
        return {"note": f"skipped: bench.cache_shm is not available ({e})", "rows": []}
    num_procs = _ints(a.shm_procs)
    try:
        rows = run_shm_bench(_ints(a.shm_sizes), num_procs, a.shm_seconds)
    except Exception as e:  # the simulation results still get written; the error is reported and fails the run
        return {"note": f"error: {type(e).__name__}: {e}", "rows": [], "error": True}
    return {"note": "", "rows": rows, "sizes_bytes": _ints(a.shm_sizes), "num_procs": num_procs,
            "seconds": a.shm_seconds}


def _print_tables(rows: list[dict[str, Any]], churn: dict[str, Any], shm: dict[str, Any]) -> None:
    print("\nhit rate over all requests (cold start included); E x C = capacity_frac x distinct media")
    print(markdown_table(rows, ["capacity_frac", "capacity_items", *POLICIES, "ch_vs_rr", "rr_vs_ch_misses",
                                "ideal_gap_pts"]))
    print("\nhit rate over the second half of the requests (warm caches)")
    print(markdown_table(rows, ["capacity_frac", *(f"{p}_warm" for p in POLICIES)]))
    add = churn["add"]
    churn_rows = [
        {"event": "remove 1 (worst node)", "moved_frac": churn["remove_max_frac"], "bound": churn["bound"],
         "only_that_node": all(r["only_own_keys_moved"] for r in churn["removals"])},
        {"event": "remove 1 (mean over nodes)", "moved_frac": churn["remove_mean_frac"], "bound": churn["bound"],
         "only_that_node": all(r["only_own_keys_moved"] for r in churn["removals"])},
        {"event": "add 1", "moved_frac": add["moved_frac"], "bound": churn["bound"],
         "only_that_node": add["only_onto_new_node"]},
    ]
    print(f"\nring churn over {churn['num_keys']} route keys, {churn['num_encoders']} encoders "
          f"(bound 1/N + 2%; ideal add 1/(N+1) = {add['ideal_frac']:.3f})")
    print(markdown_table(churn_rows, ["event", "moved_frac", "bound", "only_that_node"]))
    print(f"\nshared-memory cache micro-benchmark{': ' + shm['note'] if shm['note'] else ''}")
    if shm["rows"]:
        columns = list(dict.fromkeys(k for row in shm["rows"] for k in row))
        print(markdown_table(shm["rows"], columns))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mmenc bench cache", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=Workload.num_requests)
    p.add_argument("--distinct", type=int, default=Workload.num_distinct, help="distinct media in the catalogue")
    p.add_argument("--zipf-s", type=float, default=Workload.zipf_s)
    p.add_argument("--seed", type=int, default=Workload.seed)
    p.add_argument("--encoders", type=int, default=8)
    p.add_argument("--workers-per-machine", type=int, default=0,
                   help="encoders sharing one machine-wide cache in the consistent_shm policy (default: all)")
    p.add_argument("--capacity-fracs", default="0.01,0.02,0.05,0.1,0.2",
                   help="share of the distinct media that all caches together hold")
    p.add_argument("--headline-frac", type=float, default=0.05, help="capacity fraction of the SUMMARY line")
    p.add_argument("--skip-shm", action="store_true", help="skip the shared-memory cache micro-benchmark")
    p.add_argument("--shm-sizes", default="65536,1048576,4194304", help="entry sizes in bytes")
    p.add_argument("--shm-procs", default="1,8", help="process counts, comma-separated (1 and 8, as the issue asks)")
    p.add_argument("--shm-seconds", type=float, default=2.0)
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--name", default="cache")
    a = p.parse_args(argv)
    if a.encoders < 1:
        p.error("--encoders must be >= 1")
    workers_per_machine = a.workers_per_machine or a.encoders
    fracs = sorted(set(_floats(a.capacity_fracs)) | {a.headline_frac})
    try:
        work = Workload(a.requests, a.distinct, a.zipf_s, a.seed)
    except ValueError as e:
        p.error(str(e))

    start = time.perf_counter()
    rows = hit_rate_sweep(work, a.encoders, fracs, workers_per_machine)
    for row in rows:
        row["rr_vs_ch_misses"] = (1 - row["round_robin"]) / max(1e-12, 1 - row["consistent"])
    sim_s = time.perf_counter() - start
    catalogue = np.arange(a.distinct)
    churn = ring_churn(a.encoders, catalogue)
    shm = _shm_section(a)

    head = next(r for r in rows if r["capacity_frac"] == a.headline_frac)
    targets = {"ch_vs_rr": {"value": head["ch_vs_rr"], "target": f">= {TARGET_CH_VS_RR}",
                            "met": head["ch_vs_rr"] >= TARGET_CH_VS_RR},
               "ideal_gap_pts": {"value": head["ideal_gap_pts"], "target": f"<= {TARGET_IDEAL_GAP_PTS}",
                                 "met": head["ideal_gap_pts"] <= TARGET_IDEAL_GAP_PTS},
               "churn": {"value": max(churn["remove_max_frac"], churn["add"]["moved_frac"]),
                         "target": f"<= {churn['bound']:.4f}", "met": churn["ok"]}}
    workload = {"requests": a.requests, "distinct": a.distinct, "zipf_s": a.zipf_s, "seed": a.seed,
                "distinct_requested": int(np.unique(work.requests()).size)}
    payload = {"bench": "cache", "workload": workload,
               "encoders": a.encoders, "workers_per_machine": workers_per_machine, "headline_frac": a.headline_frac,
               "sim_seconds": sim_s, "rows": rows, "targets": targets, "churn": churn, "shm": shm,
               "env": _environment(), "argv": argv if argv is not None else sys.argv[1:]}
    path = write_results(a.name, a.out_dir, payload)
    _print_tables(rows, churn, shm)
    ok = ", ".join(f"{k} {'met' if t['met'] else 'MISSED'}" for k, t in targets.items())
    print(f"SUMMARY cache zipf {a.zipf_s} {a.requests} req / {a.distinct} media, {a.encoders} encoders, caches "
          f"{a.headline_frac:.0%}: consistent {head['consistent']:.3f} vs round-robin {head['round_robin']:.3f} hit "
          f"({head['ch_vs_rr']:.2f}x, {head['rr_vs_ch_misses']:.2f}x fewer misses), ideal {head['ideal']:.3f} "
          f"(gap {head['ideal_gap_pts']:.2f} pt); churn remove <= {churn['remove_max_frac']:.1%}, add "
          f"{churn['add']['moved_frac']:.1%} (bound {churn['bound']:.1%}); {ok}; sim {sim_s:.1f}s; results in {path}")
    return 1 if shm.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
