"""`mmenc bench serve`: load test of `/v1/embeddings`, against a running server or one started here.

Closed loop (`--concurrency N` or `--sweep 1,4,16,64`: N users, each sends its next request when the
previous one answered) or open loop (`--rate R[,R2...]` requests/s, Poisson arrivals, seeded). Images
come from a local media server (or inline as data URIs) in a mix of sizes (`--mix`), with bytes unique
per request so no cache can answer from memory. With `--start`, the same load also runs against the
naive baseline (`bench/naive_server.py`: transformers, one request at a time, same weights) and the
report gives mmenc/naive. Reports throughput, latency percentiles, per-stage means from the answers'
`timings_ms`, errors by class, and the server's batching from `/metrics` deltas.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp

from bench.loadgen import LoadSpec, Progress, get_text, json_or_none, run_load
from bench.media import ImageMix, MediaServer, RequestFactory, generate_images
from bench.procs import ManagedServer, compare_embeddings, health_status
from bench.serve_report import (
    DEPTH,
    WorkerSamples,
    label_values,
    parse_metrics,
    per_worker_stats,
    ratios,
    server_stats,
    starved_fraction,
    summarize,
    worker_samples,
)

COLUMNS = ["server", "step", "ok", "errors", "rps", "img_s", "tokens_s", "p50_ms", "p90_ms", "p99_ms", "mean_ms",
           "fetch_ms", "decode_ms", "queue_ms", "preprocess_ms", "encode_ms", "total_ms", "forwards",
           "items_per_forward", "tokens_per_forward", "busy_fraction"]


WORKER_COLUMNS = ["step", "worker", "forwards", "item_share", "items_per_forward", "tokens_per_forward",
                  "busy_fraction", "queue_depth_mean", "queue_depth_max", "starved_fraction"]


def worker_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per (step, worker): the fleet's balance."""
    return [{"step": r["step"], "starved_fraction": _cell(r.get("starved_fraction")),
             **{k: _cell(v) for k, v in w.items()}} for r in rows for w in r.get("workers") or []]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmenc bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="base URL of a running server (it must allow loopback media URLs)")
    target.add_argument("--start", action="store_true", help="start `mmenc serve` here, stop it at the end")
    p.add_argument("--server-args", default="",
                   help="flags for the started `mmenc serve`, one string (a single flag: --server-args='--flag')")
    p.add_argument("--startup-timeout-s", type=float, default=900.0, help="wait for /health (GPU compile)")
    p.add_argument("--mix", default="mixed", help="448 | 1080p | 4k | mixed | S | WxH | size=weight,...")
    p.add_argument("--distinct", type=int, default=32, help="different images per size")
    p.add_argument("--unique", action=argparse.BooleanOptionalAction, default=True,
                   help="unique bytes per image sent (a JPEG comment with a counter), so caches miss")
    p.add_argument("--items-per-request", type=int, default=1)
    p.add_argument("--as-data-uri", action="store_true", help="send base64 data URIs instead of URLs")
    p.add_argument("--encoding-format", default="base64", choices=["base64", "float"])
    p.add_argument("--pooling", help="request pooling (server default: mean); none returns every token's embedding")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, default=8, help="closed loop: virtual users")
    mode.add_argument("--sweep", type=_ints, help="closed loop: several concurrencies, one row each (1,4,16,64)")
    mode.add_argument("--rate", type=_floats, help="open loop: requests/s, Poisson arrivals (one or a list)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds per step (0: only --num-requests)")
    p.add_argument("--num-requests", type=int, help="requests per step (stops at whichever comes first)")
    p.add_argument("--warmup-requests", type=int, default=16, help="per step, before the timed phase "
                   "(plus once per server at the highest step: max(this, 2 x concurrency))")
    p.add_argument("--timeout-s", type=float, default=300.0, help="client timeout per request")
    p.add_argument("--max-connections", type=int, default=1024, help="client connection limit (open loop)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", choices=["naive", "none"], help="default: naive with --start, none with --url")
    p.add_argument("--baseline-steps", help="steps for the baseline (default: those <= 8, else the smallest)")
    p.add_argument("--baseline-duration", type=float, help="seconds per baseline step (default: --duration)")
    p.add_argument("--naive-preset", help="default: --vision-model of --server-args, else tiny")
    p.add_argument("--naive-device", default="auto")
    p.add_argument("--metrics-interval-s", type=float, default=1.0, help="queue-depth sampling period")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--name", default="serve")
    return p


async def _metrics(session: aiohttp.ClientSession, url: str) -> str | None:
    status, text = await get_text(session, url + "/metrics")
    return text if status == 200 else None


async def _sample_timeline(session: aiohttp.ClientSession, url: str, interval_s: float,
                           timeline: list[tuple[float, WorkerSamples]]) -> None:
    """Every `interval_s`: each worker's samples (queue depth, busy seconds); stops if none are exported."""
    while True:
        await asyncio.sleep(interval_s)
        snapshot = worker_samples(await _metrics(session, url))
        if not any(DEPTH in per for per in snapshot.values()):
            return
        timeline.append((time.perf_counter(), snapshot))


def _one_line(label: str, row: dict[str, Any]) -> str:
    def fmt(key: str, spec: str = ".1f") -> str:
        return "n/a" if row.get(key) is None else format(row[key], spec)

    return (f"{label}: {fmt('rps')} req/s, {fmt('img_s')} img/s, p50 {fmt('p50_ms', '.0f')} ms, "
            f"p99 {fmt('p99_ms', '.0f')} ms, {row['errors']} errors, {fmt('items_per_forward')} items/forward, "
            f"busy {fmt('busy_fraction', '.2f')}")


async def _warm_up(session: aiohttp.ClientSession, url: str, concurrency: int, num_requests: int,
                   make_body: RequestFactory, a: argparse.Namespace) -> None:
    """Untimed requests (compile, caches, connections); failures are reported on stderr, not counted."""
    spec = LoadSpec(url + "/v1/embeddings", concurrency=concurrency, num_requests=num_requests, timeout_s=a.timeout_s)
    records, _ = await run_load(session, spec, make_body, Progress("warm-up", enabled=False))
    failed = Counter(f"{r.status} {r.code}" for r in records if not r.ok)
    if failed:
        hint = (" (a --url server needs --allow-private-urls for the loopback media URLs, or use --as-data-uri)"
                if any("forbidden_source" in k for k in failed) else "")
        print(f"warm-up against {url}: {sum(failed.values())}/{len(records)} failed: {dict(failed)}{hint}",
              file=sys.stderr, flush=True)


async def run_target(name: str, url: str, steps: list[float], a: argparse.Namespace,
                     make_factory: Callable[[], RequestFactory]) -> list[dict[str, Any]]:
    """Every step (a concurrency, or a rate in open loop) against one server: warm-up, then the timed phase."""
    is_open = a.rate is not None
    limit = max(a.max_connections if is_open else int(max(steps)), 1) + 4
    rows = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit)) as session:
        health = json_or_none((await get_text(session, url + "/health"))[1]) or {}
        num_workers = sum(1 for w in health.get("workers", []) if w.get("ready")) or 1
        duration = (a.baseline_duration if name == "naive" and a.baseline_duration else a.duration) or None
        if a.warmup_requests:  # once at the highest load, so that the largest batches are compiled too
            peak = 8 if is_open else int(max(steps))
            await _warm_up(session, url, peak, max(a.warmup_requests, 2 * peak), make_factory(), a)
        for step in steps:
            load = dict(rate=step) if is_open else dict(concurrency=int(step))
            spec = LoadSpec(url + "/v1/embeddings", duration_s=duration, num_requests=a.num_requests,
                            timeout_s=a.timeout_s, seed=a.seed, **load)  # type: ignore[arg-type]
            factory = make_factory()
            if a.warmup_requests:
                await _warm_up(session, url, min(a.warmup_requests, spec.concurrency or 4), a.warmup_requests,
                               make_factory(), a)
            before = await _metrics(session, url)
            timeline: list[tuple[float, WorkerSamples]] = [(time.perf_counter(), worker_samples(before))]
            sampler = asyncio.create_task(_sample_timeline(session, url, a.metrics_interval_s, timeline))
            label = f"{name} {'rate' if is_open else 'c'}={step:g}"
            with Progress(label, enabled=not a.no_progress) as progress:
                records, wall_s = await run_load(session, spec, factory, progress)
            sampler.cancel()
            after = await _metrics(session, url)
            workers = len(label_values(after, "mmenc_encode_busy_seconds_total", "worker")) or num_workers
            depths = [sum(per.get(DEPTH, 0.0) for per in snap.values()) for _, snap in timeline[1:]]
            row = {"server": name, "step": step, "mode": "open" if is_open else "closed",
                   "concurrency": spec.concurrency, "rate": spec.rate,
                   **summarize(records, wall_s),
                   **server_stats(parse_metrics(before), parse_metrics(after), wall_s, workers, depths),
                   "starved_fraction": starved_fraction(timeline),
                   "workers": per_worker_stats(worker_samples(before), worker_samples(after), wall_s, timeline)}
            rows.append(row)
            print(_one_line(label, row), flush=True)
    return rows


def _naive_preset(a: argparse.Namespace) -> str:
    if a.naive_preset:
        return a.naive_preset
    args = shlex.split(a.server_args)
    spec = next((args[i + 1] for i, x in enumerate(args[:-1]) if x == "--vision-model"), "tiny")
    spec = next((x.split("=", 1)[1] for x in args if x.startswith("--vision-model=")), spec)
    from encoder_server.config import VISION_PRESETS

    if spec not in VISION_PRESETS:
        raise ValueError(f"the naive baseline takes a preset {sorted(VISION_PRESETS)}, not {spec!r}; "
                         "pass --naive-preset or --baseline none")
    return spec


def _check_reachable(url: str) -> dict[str, Any]:
    status, text = health_status(url)
    if status == 0:
        raise RuntimeError(f"cannot reach {url}/health: {text}")
    if status != 200:
        raise RuntimeError(f"{url}/health answered {status}, the server is not ready: {text[:300]}")
    return json_or_none(text) or {}


def _run(a: argparse.Namespace, argv: list[str]) -> int:
    mix = ImageMix.parse(a.mix)
    is_open = a.rate is not None
    steps: list[float] = a.rate if is_open else [float(c) for c in (a.sweep or [a.concurrency])]
    if not steps or min(steps) <= 0 or a.distinct < 1 or a.items_per_request < 1:
        raise ValueError("steps, --distinct and --items-per-request must be > 0")
    if not a.duration and not a.num_requests:
        raise ValueError("give --duration > 0 or --num-requests")
    start = time.perf_counter()
    baseline = a.baseline or ("naive" if a.start else "none")
    baseline_steps = (_floats(a.baseline_steps) if a.baseline_steps
                      else [s for s in steps if s <= 8] or [min(steps)])
    out_dir = Path(a.out_dir)
    if a.url:
        _check_reachable(a.url.rstrip("/"))
    with ExitStack() as stack:
        servers: dict[str, ManagedServer] = {}
        if a.start:
            servers["mmenc"] = ManagedServer("mmenc", ["encoder_server.cli", "serve"],
                                             ["--allow-private-urls", *shlex.split(a.server_args)],
                                             out_dir / f"{a.name}.mmenc.log")
        if baseline == "naive":
            servers["naive"] = ManagedServer("naive", ["bench.naive_server"],
                                             ["--preset", _naive_preset(a), "--device", a.naive_device],
                                             out_dir / f"{a.name}.naive.log")
        for server in servers.values():  # start all, then generate images while they load
            stack.callback(server.stop)
            server.start()
        images = generate_images(mix, a.distinct, a.seed)
        media = None if a.as_data_uri else stack.enter_context(MediaServer(images))
        for server in servers.values():
            server.wait_healthy(a.startup_timeout_s)
        url = a.url.rstrip("/") if a.url else servers["mmenc"].url
        health = _check_reachable(url)
        nonces = itertools.count()

        def make_factory() -> RequestFactory:
            return RequestFactory(mix, images, media, a.items_per_request, is_data_uri=a.as_data_uri,
                                  is_unique=a.unique, encoding_format=a.encoding_format, nonces=nonces, seed=a.seed,
                                  pooling=a.pooling)

        rows = asyncio.run(run_target("mmenc", url, steps, a, make_factory))
        naive_rows, baseline_info = [], None
        if "naive" in servers:
            naive = servers["naive"]
            naive_rows = asyncio.run(run_target("naive", naive.url, baseline_steps, a, make_factory))
            baseline_info = {"kind": "naive", "preset": _naive_preset(a), "health": _check_reachable(naive.url),
                             "agreement": compare_embeddings(url, naive.url, images[mix.labels[0]][0])}
    startup_s = {name: server.startup_s for name, server in servers.items()}
    extra = {"target": {"url": a.url, "started": a.start, "server_args": a.server_args, "health": health},
             "baseline": baseline_info, "startup_s": startup_s, "total_s": time.perf_counter() - start}
    return _report(a, argv, mix, extra, rows, naive_rows)


def _cell(value: Any) -> Any:
    """Table cell: '-' for null, whole numbers from 100 up (markdown_table prints other floats to 3 digits)."""
    if value is None:
        return "-"
    return round(value) if isinstance(value, float) and abs(value) >= 100 else value


def _report(a: argparse.Namespace, argv: list[str], mix: ImageMix, extra: dict[str, Any],
            rows: list[dict[str, Any]], naive_rows: list[dict[str, Any]]) -> int:
    import torch

    from bench.common import environment, markdown_table, write_results

    ratio = ratios(rows, naive_rows, "step") if naive_rows else None
    payload = {
        "bench": "serve", "mode": rows[0]["mode"], "mix": mix.describe(), "distinct": a.distinct,
        "unique_bytes": a.unique, "items_per_request": a.items_per_request, "as_data_uri": a.as_data_uri,
        "encoding_format": a.encoding_format, "pooling": a.pooling, "duration_s": a.duration,
        "num_requests": a.num_requests,
        "warmup_requests": a.warmup_requests, **extra,
        "env": environment(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
        "argv": argv, "rows": rows + naive_rows, "ratio": ratio,
    }
    path = write_results(a.name, a.out_dir, payload)
    table_rows = [{k: _cell(v) for k, v in r.items()} for r in rows + naive_rows]
    print(markdown_table(table_rows, COLUMNS))
    if any(len(r.get("workers") or []) > 1 for r in rows):
        print(markdown_table(worker_table(rows), WORKER_COLUMNS))
    best = max(rows, key=lambda r: r["img_s"])
    step = f"{'rate' if best['mode'] == 'open' else 'concurrency'} {best['step']:g}"
    busy = f", busy {best['busy_fraction']:.2f}" if best["busy_fraction"] is not None else ""
    p50 = f"{best['p50_ms']:.0f} ms" if best["p50_ms"] is not None else "n/a"
    line = (f"SUMMARY serve {a.mix} x{a.items_per_request}: mmenc {best['img_s']:.1f} img/s "
            f"({best['rps']:.1f} req/s, {best['tokens_s']} tok/s) at {step}, p50 {p50}{busy}")
    if ratio is not None:
        naive_best = max(r["img_s"] for r in naive_rows)
        line += f"; naive {naive_best:.1f} img/s -> {ratio['peak_img_s'] or 0:.1f}x"
    num_errors = sum(r["errors"] for r in rows + naive_rows)
    print(f"{line}; {num_errors} errors; results in {path}", flush=True)
    return 0 if any(r["ok"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = build_parser().parse_args(argv)
    try:
        return _run(a, argv)
    except (RuntimeError, ValueError) as e:  # unreachable server, failed startup, bad flags: one clear message
        print(f"mmenc bench serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
