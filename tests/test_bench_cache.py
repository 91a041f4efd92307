"""`mmenc bench cache`: the simulation's building blocks and a small end-to-end run."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from bench import cache as bench_cache
from bench.cache_sim import POLICIES, Workload, lru_hits


def test_lru_evicts_the_least_recently_used() -> None:
    items = np.array([1, 2, 1, 3, 2, 1])  # cap 2: miss, miss, hit, miss (evicts 2), miss (evicts 1), miss
    assert lru_hits(items, np.zeros(6, dtype=np.int64), 1, 2) == (1, 0)
    assert lru_hits(items, np.zeros(6, dtype=np.int64), 1, 3, split=3) == (1, 2)
    assert lru_hits(items, np.array([0, 1, 0, 1, 1, 0]), 2, 1) == (2, 0)  # one LRU per cache; default split: all


def test_zipf_workload_is_seeded_and_skewed() -> None:
    work = Workload(num_requests=50_000, num_distinct=1000, zipf_s=1.1, seed=3)
    requests = work.requests()
    assert np.array_equal(requests, work.requests())
    assert requests.min() >= 0 and requests.max() < 1000
    top = np.bincount(requests, minlength=1000).max() / len(requests)
    expected = 1 / (np.arange(1, 1001) ** -1.1).sum()  # P(rank 1)
    assert abs(top - expected) < 0.01
    with pytest.raises(ValueError):
        Workload(num_requests=0)


def test_small_run_beats_round_robin_and_bounds_churn(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "bench.cache_shm", None)  # as if the shm benchmark were missing
    argv = ["--requests", "20000", "--distinct", "20000", "--capacity-fracs", "0.02,0.05", "--out-dir",
            str(tmp_path), "--name", "small"]
    assert bench_cache.main(argv) == 0
    payload = json.loads((tmp_path / "small.json").read_text())
    assert {"workload", "encoders", "rows", "targets", "churn", "shm", "env", "sim_seconds"} <= payload.keys()
    assert [r["capacity_frac"] for r in payload["rows"]] == [0.02, 0.05]
    for row in payload["rows"]:
        assert {*POLICIES, *(f"{p}_warm" for p in POLICIES), "ch_vs_rr", "ideal_gap_pts"} <= row.keys()
        assert row["consistent"] > 1.1 * row["round_robin"]
        assert row["consistent"] > 1.1 * row["random"]
        assert row["ideal_gap_pts"] <= 2.0
        assert row["consistent_shm"] == row["ideal"]  # one machine: every encoder shares the one arena
    churn = payload["churn"]
    assert churn["ok"] and churn["remove_max_frac"] <= 1 / 8 + 0.02 and churn["add"]["moved_frac"] <= 1 / 8 + 0.02
    assert all(r["only_own_keys_moved"] for r in churn["removals"]) and len(churn["removals"]) == 8
    assert payload["targets"]["ideal_gap_pts"]["met"] and payload["targets"]["churn"]["met"]
    assert "bench.cache_shm is not available" in payload["shm"]["note"] and payload["shm"]["rows"] == []
    out = capsys.readouterr().out
    assert out.count("SUMMARY cache") == 1 and "| capacity_frac |" in out


def test_shm_section_runs_the_real_shm_benchmark() -> None:
    ns = type("NS", (), {"skip_shm": False, "shm_sizes": "65536,1048576", "shm_procs": "1,2", "shm_seconds": 0.2})
    section = bench_cache._shm_section(ns)  # type: ignore[arg-type]
    assert section["note"] == "" and len(section["rows"]) == 4, section
    assert all(row["get_p50_us"] > 0 and row["get_gbps_proc"] > 0 for row in section["rows"])
    ns.skip_shm = True
    assert bench_cache._shm_section(ns)["note"].startswith("skipped")  # type: ignore[arg-type]


def test_cli_routes_bench_cache(tmp_path) -> None:
    from encoder_server.cli import main

    argv = ["bench", "cache", "--requests", "2000", "--distinct", "500", "--encoders", "4", "--capacity-fracs",
            "0.05", "--skip-shm", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    assert json.loads((tmp_path / "cache.json").read_text())["encoders"] == 4
