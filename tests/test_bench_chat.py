"""`mmenc bench chat` end to end on the CPU: both modes (two real `mmenc serve` with tiny models), cold and warm,
one concurrency level, short points; plus the report's helpers."""

from __future__ import annotations

import json

import pytest

from bench.chat import main
from bench.chat_report import ChatRecord, cache_lookups, ratios, summarize

SERVER_ARGS = "--device cpu --num-workers 1 --num-fetch-procs 1 --cache-bytes 67108864"
SMOKE = ["--llm", "tiny", "--vision-model", "tiny", "--server-args", SERVER_ARGS,
         "--concurrency", "2", "--duration", "1.5", "--mix", "224", "--prompt-words", "12", "--max-tokens", "4",
         "--warm-set", "2", "--distinct", "2", "--warmup-requests", "2", "--no-progress"]


def test_smoke_run_has_every_point(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # NOTE: 2 servers' workers and engines on 2 cores: no oversubscription
    assert main([*SMOKE, "--out-dir", str(tmp_path), "--name", "run"]) == 0
    result = json.loads((tmp_path / "run.json").read_text())
    rows = {(r["mode"], r["cache"], r["concurrency"]): r for r in result["rows"]}
    assert set(rows) == {(m, c, 2) for m in ("overlap", "encode-then-prefill") for c in ("cold", "warm")}
    for row in rows.values():
        assert row["ok"] > 0 and row["errors"] == 0 and row["error_classes"] == {}
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] and row["ttft_p50_ms"] <= row["e2e_p50_ms"]
        assert row["out_tok_s"] > 0 and 0 < row["completion_tokens"] <= 4
    for mode in ("overlap", "encode-then-prefill"):
        cold, warm = rows[(mode, "cold", 2)], rows[(mode, "warm", 2)]
        # cold: nothing seen before (only the chat template's first tokens repeat); warm: both caches answer
        assert cold["enc_cache_hits"] == 0 and cold["cached_tokens"] < 0.2 * cold["prompt_tokens"]
        assert warm["enc_cache_hit_rate"] > 0.5 and warm["cached_tokens"] > 0.5 * warm["prompt_tokens"]
    by_mode = result["ratios"]["overlap_vs_encode-then-prefill"]
    assert len(by_mode) == 2 and all(r["ttft_p50_ratio"] > 0 for r in by_mode)
    assert len(result["ratios"]["warm_vs_cold"]) == 2
    assert {s["startup_s"] > 0 for s in result["servers"].values()} == {True}
    out = capsys.readouterr().out
    assert out.count("SUMMARY chat") == 1 and "| overlap | warm | 2 |" in out


def test_bad_flags_are_a_clear_error(tmp_path, capsys):
    assert main(["--server-args=--no-llm-overlap", "--out-dir", str(tmp_path)]) == 2
    assert "--server-args must not set" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--modes", "overlap,fast"])


def test_summary_and_ratios():
    def rec(ttft: float, cached: int = 0) -> ChatRecord:
        return ChatRecord(latency_s=2 * ttft, ttft_s=ttft, status=200, code=None, num_images=1, prompt_tokens=100,
                          completion_tokens=5, cached_tokens=cached, end_at=0.0)

    failed = ChatRecord(0.1, None, 503, "unavailable", 1)
    row = summarize([rec(0.1), rec(0.3, 99), failed], 2.0, {"hit": 1.0, "miss": 4.0}, {"hit": 3.0, "miss": 4.0})
    assert row["ok"] == 2 and row["errors"] == 1 and row["error_classes"] == {"503 unavailable": 1}
    assert row["ttft_p50_ms"] == pytest.approx(200) and row["out_tok_s"] == pytest.approx(5.0)
    assert row["cached_tokens"] == pytest.approx(49.5) and row["enc_cache_hit_rate"] == pytest.approx(1.0)
    assert summarize([failed], 1.0, {}, {})["ttft_p50_ms"] is None

    def point(mode: str, cache: str, ttft: float) -> dict:
        return {"mode": mode, "cache": cache, "concurrency": 1, "ttft_p50_ms": ttft, "ttft_p99_ms": ttft,
                "e2e_p50_ms": ttft, "out_tok_s": 1.0}

    rows = [point("overlap", "cold", 50), point("encode-then-prefill", "cold", 100), point("overlap", "warm", 10)]
    out = ratios(rows, "overlap", "encode-then-prefill")
    assert out["overlap_vs_encode-then-prefill"] == [
        {"cache": "cold", "concurrency": 1, "ttft_p50_ratio": 0.5, "ttft_p99_ratio": 0.5, "e2e_p50_ratio": 0.5}]
    assert out["warm_vs_cold"][0]["ttft_p50_ratio"] == pytest.approx(0.2)


def test_cache_lookups_sums_by_result():
    text = ('# TYPE mmenc_cache_lookups_total counter\n'
            'mmenc_cache_lookups_total{kind="route",result="hit"} 3\n'
            'mmenc_cache_lookups_total{kind="content",result="hit"} 1\n'
            'mmenc_cache_lookups_total{kind="route",result="miss"} 2\n')
    assert cache_lookups(text) == {"hit": 4.0, "miss": 2.0}
    assert cache_lookups(None) == {} and cache_lookups("<html>") == {}
