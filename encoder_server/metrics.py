"""Prometheus metrics of the gateway and the workers, exported by the gateway at `/metrics`.

The processes share them through prometheus-client's multiprocess mode: the supervisor points
`PROMETHEUS_MULTIPROC_DIR` at a fresh directory before anything imports prometheus_client
(`logs.enable_multiprocess_metrics`), children inherit it, and `/metrics` aggregates every process's files.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

_ENV = "PROMETHEUS_MULTIPROC_DIR"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

REQUESTS = Counter("mmenc_requests_total", "HTTP requests by route and status", ["route", "status"])
REQUEST_SECONDS = Histogram("mmenc_request_seconds", "HTTP request latency", ["route"], buckets=_LATENCY_BUCKETS)
ITEMS = Counter("mmenc_items_total", "Media items received by workers", ["modality"])
ERRORS = Counter("mmenc_errors_total", "Failed items by error code", ["code"])
STAGE_SECONDS = Histogram("mmenc_stage_seconds", "Per-item time in each stage", ["stage"], buckets=_LATENCY_BUCKETS)
FORWARDS = Counter("mmenc_forwards_total", "Encoder forwards", ["worker", "modality"])
FORWARD_ITEMS = Histogram("mmenc_forward_items", "Items per encoder forward", ["worker"],
                          buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
FORWARD_TOKENS = Histogram("mmenc_forward_tokens", "Patches per encoder forward", ["worker"],
                           buckets=(256, 1024, 4096, 8192, 16384, 32768, 65536, 131072, 262144))
ENCODE_BUSY = Counter("mmenc_encode_busy_seconds_total", "Time spent in encoder forwards", ["worker"])
QUEUE_DEPTH = Gauge("mmenc_queue_depth", "Items fetched and waiting for a forward", ["worker"],
                    multiprocess_mode="livesum")
CACHE_LOOKUPS = Counter("mmenc_cache_lookups_total", "Embedding cache lookups: kind route|content, result hit|miss",
                        ["kind", "result"])
ROUTE_SPILLS = Counter("mmenc_route_spills_total", "Items sent past their ring owner by bounded-load routing")
WORKER_RESTARTS = Counter("mmenc_worker_restarts_total", "Encoder worker restarts by the supervisor", ["worker"])


def render() -> bytes:
    """Text exposition of all processes' metrics (or this process's when not in multiprocess mode)."""
    if _ENV in os.environ:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)
    return generate_latest()


def mark_process_dead(pid: int) -> None:
    """Drop a dead worker's live gauges (its counters stay in the totals)."""
    if _ENV in os.environ:
        multiprocess.mark_process_dead(pid)
