"""Turn `mmenc bench chat` request records and `/metrics` scrapes into result rows, ratios and the report.

One row per point (mode, cache state, concurrency). TTFT is the time from sending a request to its first
SSE event (the server sends the role chunk once the first token exists); end to end runs to `[DONE]`.
Encoder cache hits come from the delta of `mmenc_cache_lookups_total{result="hit"|"miss"}` across the timed
phase (a route hit skips the download, a content hit the forward).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.common import markdown_table

COLUMNS = ["mode", "cache", "concurrency", "requests", "errors", "ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms",
           "e2e_p99_ms", "out_tok_s", "rps", "prompt_tokens", "cached_tokens", "enc_cache_hit_rate"]
RATIO_COLUMNS = ["cache", "concurrency", "ttft_p50_ratio", "ttft_p99_ratio", "e2e_p50_ratio"]


@dataclass
class ChatRecord:
    """One streamed chat. Times in seconds from when the request was sent; `ttft_s` is None without any event."""

    latency_s: float
    ttft_s: float | None
    status: int  # HTTP status; 0 when no HTTP answer came
    code: str | None  # None on success; else the error's `code` or a client-side class
    num_images: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    end_at: float = 0.0  # time.perf_counter() when the stream ended

    @property
    def ok(self) -> bool:
        return self.code is None


def cache_lookups(text: str | None) -> dict[str, float]:
    """Encoder cache lookups by result ("hit", "miss") summed over kinds and workers; {} without metrics."""
    if not text:
        return {}
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "mmenc_cache_lookups_total" and "result" in s.labels:
                    out[s.labels["result"]] = out.get(s.labels["result"], 0.0) + float(s.value)
    except ValueError:
        return {}
    return out


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def summarize(records: list[ChatRecord], wall_s: float, lookups_before: dict[str, float],
              lookups_after: dict[str, float]) -> dict[str, Any]:
    """Throughput, TTFT / end-to-end percentiles (ms, successful requests), token means and cache hits."""
    ok = [r for r in records if r.ok]
    ttft_ms = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    e2e_ms = [r.latency_s * 1e3 for r in ok]
    tpot_ms = [(r.latency_s - r.ttft_s) * 1e3 / (r.completion_tokens - 1) for r in ok
               if r.ttft_s is not None and r.completion_tokens > 1]
    out_tokens = sum(r.completion_tokens for r in ok)
    hits = lookups_after.get("hit", 0.0) - lookups_before.get("hit", 0.0)
    misses = lookups_after.get("miss", 0.0) - lookups_before.get("miss", 0.0)
    num_images = sum(r.num_images for r in ok)
    return {
        "requests": len(records), "ok": len(ok), "errors": len(records) - len(ok), "wall_s": wall_s,
        "rps": len(ok) / wall_s if wall_s > 0 else 0.0,
        "out_tok_s": out_tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_p50_ms": _pct(ttft_ms, 50), "ttft_p90_ms": _pct(ttft_ms, 90), "ttft_p99_ms": _pct(ttft_ms, 99),
        "ttft_mean_ms": _mean(ttft_ms),
        "e2e_p50_ms": _pct(e2e_ms, 50), "e2e_p99_ms": _pct(e2e_ms, 99), "tpot_mean_ms": _mean(tpot_ms),
        "prompt_tokens": _mean([float(r.prompt_tokens) for r in ok]),
        "completion_tokens": _mean([float(r.completion_tokens) for r in ok]),
        "cached_tokens": _mean([float(r.cached_tokens) for r in ok]),
        "images": num_images,
        "enc_cache_hits": hits if lookups_after else None,
        # NOTE: a route miss is followed by a content lookup, so hits / images, not hits / lookups
        "enc_cache_hit_rate": hits / num_images if lookups_after and num_images else None,
        "enc_cache_misses": misses if lookups_after else None,
        "error_classes": dict(Counter(f"{r.status} {r.code}" for r in records if not r.ok)),
    }


def _over(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(rows: list[dict[str, Any]], mode: str, baseline: str) -> dict[str, list[dict[str, Any]]]:
    """`mode` over `baseline` at each (cache, concurrency), and warm over cold for each (mode, concurrency).
    A ratio below 1 means the first is faster."""
    index = {(r["mode"], r["cache"], r["concurrency"]): r for r in rows}
    by_mode = []
    for (m, cache, c), r in index.items():
        base = index.get((baseline, cache, c))
        if m != mode or base is None:
            continue
        by_mode.append({"cache": cache, "concurrency": c,
                        **{f"{k}_ratio": _over(r[f"{k}_ms"], base[f"{k}_ms"])
                           for k in ("ttft_p50", "ttft_p99", "e2e_p50")}})
    warm_cold = []
    for (m, cache, c), r in index.items():
        cold = index.get((m, "cold", c))
        if cache == "warm" and cold is not None:
            warm_cold.append({"mode": m, "concurrency": c,
                              "ttft_p50_ratio": _over(r["ttft_p50_ms"], cold["ttft_p50_ms"]),
                              "out_tok_s_ratio": _over(r["out_tok_s"], cold["out_tok_s"])})
    return {f"{mode}_vs_{baseline}": by_mode, "warm_vs_cold": warm_cold}


def _cell(value: Any) -> Any:
    """'-' for null, whole numbers from 100 up (markdown_table prints other floats to 3 digits)."""
    if value is None:
        return "-"
    return round(value) if isinstance(value, float) and abs(value) >= 100 else value


def tables(rows: list[dict[str, Any]], by_mode: list[dict[str, Any]]) -> str:
    main = markdown_table([{k: _cell(v) for k, v in r.items()} for r in rows], COLUMNS)
    return main + "\n\n" + markdown_table([{k: _cell(v) for k, v in r.items()} for r in by_mode], RATIO_COLUMNS)


def _range(values: list[float | None]) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "n/a"
    lo, hi = min(present), max(present)
    return f"{lo:.2f}x" if abs(hi - lo) < 0.005 else f"{lo:.2f}-{hi:.2f}x"


def summary_line(label: str, rows: list[dict[str, Any]], ratio: dict[str, list[dict[str, Any]]], mode: str,
                 baseline: str, path: str) -> str:
    """One line: overlap / encode-then-prefill TTFT p50 per cache state (range over concurrencies), warm / cold
    TTFT p50 for `mode`, peak output tokens/s, errors."""
    parts = []
    for cache in ("cold", "warm"):
        points = [r for r in ratio[f"{mode}_vs_{baseline}"] if r["cache"] == cache]
        if points:
            parts.append(f"{cache} {_range([p['ttft_p50_ratio'] for p in points])}")
    line = f"SUMMARY chat {label}: TTFT p50 {mode}/{baseline} " + (", ".join(parts) or "n/a")
    warm_cold = [r["ttft_p50_ratio"] for r in ratio["warm_vs_cold"] if r["mode"] == mode]
    if warm_cold:
        line += f"; warm/cold {_range(warm_cold)}"
    ours = [r for r in rows if r["mode"] == mode] or rows
    best = max(ours, key=lambda r: r["out_tok_s"])
    ttft = "n/a" if best["ttft_p50_ms"] is None else f"{best['ttft_p50_ms']:.0f} ms"
    line += (f"; peak {best['out_tok_s']:.1f} out tok/s ({best['mode']} {best['cache']} c={best['concurrency']}, "
             f"TTFT p50 {ttft}); {sum(r['errors'] for r in rows)} errors; results in {path}")
    return line
