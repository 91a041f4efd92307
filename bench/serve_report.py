"""Turn `mmenc bench serve` request records and `/metrics` scrapes into one flat result row.

Server-side batch statistics come from the deltas of the Prometheus metrics the gateway exports:
`mmenc_forwards_total`, `mmenc_forward_items` and `mmenc_forward_tokens` (histograms),
`mmenc_encode_busy_seconds_total` and the `mmenc_queue_depth` gauge. A metric the server does not
export (an older server, or the naive baseline without `/metrics`) gives null fields, not an error.

Per worker (the samples' `worker` label): forwards, share of the items, items and patches per forward, busy
fraction and queue depth, and the balance figure of a data-parallel fleet: the share of sampling intervals
in which one worker was under half busy while another had items queued at both ends of the interval.
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise
from typing import Any

import numpy as np

from bench.loadgen import RequestRecord

STAGES = ("fetch", "decode", "queue", "preprocess", "encode")
Samples = dict[str, float]  # sample name -> value summed over all label sets
WorkerSamples = dict[str, Samples]  # worker -> sample name -> value summed over the other labels
BUSY, DEPTH = "mmenc_encode_busy_seconds_total", "mmenc_queue_depth"


def parse_metrics(text: str | None) -> Samples | None:
    """Sum every sample of a Prometheus text exposition by sample name; None when there is no text."""
    if not text:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    samples: Samples = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[sample.name] = samples.get(sample.name, 0.0) + float(sample.value)
    except ValueError:  # not Prometheus text (e.g. an HTML page): no metrics rather than no report
        return None
    return samples


def label_values(text: str | None, sample_name: str, label: str) -> set[str]:
    """The values `label` takes on the samples named `sample_name` (e.g. the workers seen)."""
    if not text:
        return set()
    from prometheus_client.parser import text_string_to_metric_families

    try:
        return {s.labels[label] for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == sample_name and label in s.labels}
    except ValueError:
        return set()


def worker_samples(text: str | None) -> WorkerSamples:
    """The samples that carry a `worker` label, summed per worker and sample name."""
    if not text:
        return {}
    from prometheus_client.parser import text_string_to_metric_families

    out: WorkerSamples = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if "worker" in sample.labels:
                    per = out.setdefault(sample.labels["worker"], {})
                    per[sample.name] = per.get(sample.name, 0.0) + float(sample.value)
    except ValueError:
        return {}
    return out


def per_worker_stats(before: WorkerSamples, after: WorkerSamples, wall_s: float,
                     timeline: list[tuple[float, WorkerSamples]]) -> list[dict[str, Any]]:
    """One row per worker seen in `after`; `timeline` holds (time, per-worker samples) scraped during the run."""
    total_items = sum(_delta(before.get(w), a, "mmenc_forward_items_sum") or 0.0 for w, a in after.items())
    rows = []
    for worker in sorted(after):
        b, a = before.get(worker), after[worker]
        items = _delta(b, a, "mmenc_forward_items_sum")
        depths = [snap[worker].get(DEPTH, 0.0) for _, snap in timeline if worker in snap]
        rows.append({
            "worker": worker, "forwards": _delta(b, a, "mmenc_forwards_total"), "items": items,
            "item_share": _ratio(items, total_items),
            "items_per_forward": _ratio(items, _delta(b, a, "mmenc_forward_items_count")),
            "tokens_per_forward": _ratio(_delta(b, a, "mmenc_forward_tokens_sum"),
                                         _delta(b, a, "mmenc_forward_tokens_count")),
            "busy_fraction": _ratio(_delta(b, a, BUSY), wall_s),
            "queue_depth_mean": _mean(depths), "queue_depth_max": max(depths) if depths else None,
        })
    return rows


def starved_fraction(timeline: list[tuple[float, WorkerSamples]]) -> float | None:
    """Share of sampling intervals in which some worker was under half busy while another had items queued at
    both ends of the interval: work waited that an idle worker could have done. None with fewer than 2 workers."""
    starved = intervals = 0
    for (t0, s0), (t1, s1) in pairwise(timeline):
        workers = sorted(set(s0) & set(s1))
        if len(workers) < 2 or t1 <= t0:
            continue
        intervals += 1
        idle = {w for w in workers if (s1[w].get(BUSY, 0.0) - s0[w].get(BUSY, 0.0)) / (t1 - t0) < 0.5}
        queued = {w for w in workers if min(s0[w].get(DEPTH, 0.0), s1[w].get(DEPTH, 0.0)) > 0}
        starved += any(q != w for q in queued for w in idle)
    return starved / intervals if intervals else None


def _delta(before: Samples | None, after: Samples | None, name: str) -> float | None:
    if after is None or name not in after:
        return None
    return after[name] - (before or {}).get(name, 0.0)


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def server_stats(before: Samples | None, after: Samples | None, wall_s: float, num_workers: int,
                 queue_depths: list[float]) -> dict[str, Any]:
    """Forwards, mean items and tokens per forward, encoder busy fraction, queue depth during the run."""
    forwards = _delta(before, after, "mmenc_forwards_total")
    busy_s = _delta(before, after, "mmenc_encode_busy_seconds_total")
    return {
        "forwards": forwards,
        "items_per_forward": _ratio(_delta(before, after, "mmenc_forward_items_sum"),
                                    _delta(before, after, "mmenc_forward_items_count")),
        "tokens_per_forward": _ratio(_delta(before, after, "mmenc_forward_tokens_sum"),
                                     _delta(before, after, "mmenc_forward_tokens_count")),
        "busy_fraction": _ratio(busy_s, wall_s * max(num_workers, 1)) if busy_s is not None else None,
        "queue_depth_mean": float(np.mean(queue_depths)) if queue_depths else None,
        "queue_depth_max": float(max(queue_depths)) if queue_depths else None,
    }


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def summarize(records: list[RequestRecord], wall_s: float) -> dict[str, Any]:
    """Throughput, latency percentiles (successful requests, ms), per-stage means and errors by class."""
    ok = [r for r in records if r.ok]
    latencies_ms = np.array([r.latency_s * 1e3 for r in ok])
    num_images = sum(r.num_images for r in ok)
    num_tokens = sum(r.num_tokens for r in ok)
    row: dict[str, Any] = {
        "requests": len(records), "ok": len(ok), "errors": len(records) - len(ok), "wall_s": wall_s,
        "rps": len(ok) / wall_s if wall_s > 0 else 0.0,
        "img_s": num_images / wall_s if wall_s > 0 else 0.0,
        "tokens_s": round(num_tokens / wall_s) if wall_s > 0 else 0,
        "tokens_per_img": num_tokens / num_images if num_images else None,
    }
    for q in (50, 90, 99):
        row[f"p{q}_ms"] = float(np.percentile(latencies_ms, q)) if len(ok) else None
    row["mean_ms"] = _mean(latencies_ms.tolist())
    row["max_ms"] = float(latencies_ms.max()) if len(ok) else None
    items = [t for r in ok for t in r.item_timings]
    for stage in STAGES:
        row[f"{stage}_ms"] = _mean([t[stage] for t in items if stage in t])
    row["total_ms"] = _mean([r.gateway_timings["total"] for r in ok if "total" in r.gateway_timings])
    row["error_classes"] = dict(Counter(f"{r.status} {r.code}" for r in records if not r.ok))
    return row


def ratios(ours: list[dict[str, Any]], naive: list[dict[str, Any]], step_key: str) -> dict[str, Any]:
    """mmenc / naive: peak throughput, and per matching step throughput and p50 latency (naive / mmenc)."""
    def peak(rows: list[dict[str, Any]]) -> float:
        return max((r["img_s"] for r in rows), default=0.0)

    out: dict[str, Any] = {"peak_img_s": peak(ours) / peak(naive) if peak(naive) else None, "per_step": []}
    by_step = {r[step_key]: r for r in ours}
    for n in naive:
        o = by_step.get(n[step_key])
        if o is None:
            continue
        out["per_step"].append({
            step_key: n[step_key],
            "img_s": o["img_s"] / n["img_s"] if n["img_s"] else None,
            "p50_speedup": n["p50_ms"] / o["p50_ms"] if n["p50_ms"] and o["p50_ms"] else None,
        })
    return out
