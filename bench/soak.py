"""`mmenc bench soak`: `/v1/embeddings` at a fixed arrival rate above capacity for a bounded time.

The claim under test (issue 8): past capacity the server sheds load with 429/503 + `Retry-After` instead of
growing queues, its memory (RSS of every process, `/dev/shm`, GPU) stays flat, and no request goes without an
answer. Phases, all in one run against one server (started here with `--start`, or `--url`):

1. warm-up, closed loop (`--warmup-concurrency` users for `--warmup-s`): compiles, fills pools, and measures
   the capacity (2xx/s) that `--overload` multiplies; the memory level at its end is the baseline.
2. soak, open loop: one request every 1/rate s (fixed spacing, no back-off on 429) for `--duration` s.
3. drain: wait for every request still out (each ends within the client timeout `--timeout-s`).

Every request ends in one class: 2xx, 429, 503, 504, 4xx, 5xx, or *lost* (no HTTP answer: client timeout,
connection reset or refused). A sampler records once a second the RSS of the gateway, each worker, its fetch
processes and the engine (pids from `/health`; RSS less shared-memory pages), the /dev/shm segments those
processes map, the GPU memory in use (`nvidia-smi`, whole device) and the queue depth from `/metrics`. The
report (`<out-dir>/<name>.json` and a plot `<name>.png`) gives each class, lost, max queue, memory
start/mid/end/max per series with a verdict (flat / plateau / growing), and 2xx latency next to the warm-up's;
the exit status is 1 when a request was lost, a 429/503 lacked `Retry-After`, or nothing succeeded.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import resource
import shlex
import sys
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.loadgen import _error_code, get_text, json_or_none
from bench.media import ImageMix, MediaServer, RequestFactory, generate_images
from bench.procs import ManagedServer, health_status
from bench.soak_probe import MemoryProbe

CLASSES = ("2xx", "429", "503", "504", "4xx", "5xx", "lost")
_SHED = ("429", "503")  # the answers that must carry Retry-After


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmenc bench soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="base URL of a running server on this machine (pids from /health)")
    target.add_argument("--start", action="store_true", help="start `mmenc serve` here, stop it at the end")
    p.add_argument("--server-args", default="", help="flags for the started `mmenc serve`, one string")
    p.add_argument("--startup-timeout-s", type=float, default=900.0)
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, help="requests/s in the soak (default: --overload x capacity)")
    load.add_argument("--overload", type=float, default=2.0, help="rate = this x the capacity measured in warm-up")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of soak")
    p.add_argument("--warmup-s", type=float, default=10.0, help="closed-loop warm-up that measures capacity")
    p.add_argument("--warmup-concurrency", type=int, default=8,
                   help="warm-up users (keep <= the server's --max-inflight-requests)")
    p.add_argument("--timeout-s", type=float, default=130.0,
                   help="client timeout per request; past it a request is lost (default: the server's 120 s + 10)")
    p.add_argument("--mix", default="448", help="image sizes, as in `mmenc bench serve`")
    p.add_argument("--distinct", type=int, default=16)
    p.add_argument("--items-per-request", type=int, default=1)
    p.add_argument("--as-data-uri", action="store_true", help="inline images instead of local media URLs")
    p.add_argument("--interval-s", type=float, default=1.0, help="sampling period")
    p.add_argument("--flat-pct", type=float, default=10.0, help="flat: end within this %% of the baseline ...")
    p.add_argument("--flat-mib", type=float, default=64.0, help="... or within this many MiB")
    p.add_argument("--max-connections", type=int, default=4096, help="client connection limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nonce-start", type=int,
                   help="first per-image nonce (default: from the clock, so no cache holds this run's images)")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--name", default="soak")
    return p


@dataclass
class Outcome:
    """One request: when it was due (s since the soak start), how long until its answer, and what it was."""

    due_s: float
    latency_s: float
    status: int  # 0: no HTTP answer
    cls: str
    has_retry_after: bool = False
    reason: str = ""  # the error body's `code`; for lost requests, the client-side exception


def classify(status: int) -> str:
    if status == 0:
        return "lost"
    if 200 <= status < 300:
        return "2xx"
    if str(status) in CLASSES:
        return str(status)
    return "4xx" if status < 500 else "5xx"


def queue_depths(text: str) -> dict[str, float]:
    """`mmenc_queue_depth` per worker from a /metrics text (empty when not exported)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        return {s.labels.get("worker", ""): s.value for f in text_string_to_metric_families(text or "")
                for s in f.samples if s.name == "mmenc_queue_depth"}
    except ValueError:
        return {}


async def send(session: aiohttp.ClientSession, url: str, body: bytes, timeout_s: float, due: float,
               t0: float) -> Outcome:
    """POST `body`; never raises for network errors (those are lost requests)."""
    status, has_retry_after, reason = 0, False, ""
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            raw = await resp.read()
            status, has_retry_after = resp.status, "Retry-After" in resp.headers
        if status >= 300:
            reason = _error_code(status, raw)
    except TimeoutError:
        reason = "client_timeout"
    except aiohttp.ClientError as e:
        reason = type(e).__name__
    return Outcome(due - t0, time.perf_counter() - due, status, classify(status), has_retry_after, reason)


class Sampler:
    """Once per `interval_s`: memory of every server process, /dev/shm, GPU, queue depth (one dict per sample)."""

    def __init__(self, session: aiohttp.ClientSession, url: str, probe: MemoryProbe, interval_s: float) -> None:
        self.session, self.url, self.probe, self.interval_s = session, url, probe, interval_s
        self.samples: list[dict[str, Any]] = []
        self.t0 = 0.0  # set when the soak starts; `t` of every sample is relative to it (warm-up: t < 0)
        self.phase = "warmup"

    async def sample(self) -> dict[str, Any]:
        health = json_or_none((await get_text(self.session, self.url + "/health"))[1]) or {}
        status, text = await get_text(self.session, self.url + "/metrics")
        depths = queue_depths(text if status == 200 else "")
        memory = await asyncio.to_thread(self.probe.sample, health)
        row = {"t": time.perf_counter(), "phase": self.phase, **memory,
               "queue_depth": sum(depths.values()) if depths else None, "queue_depth_by_worker": depths,
               "inflight_items": sum(w.get("inflight_items") or 0 for w in health.get("workers", []))}
        self.samples.append(row)
        return row

    async def run(self) -> None:
        while True:
            started = time.perf_counter()
            await self.sample()
            await asyncio.sleep(max(0.0, self.interval_s - (time.perf_counter() - started)))


async def warm_up(session: aiohttp.ClientSession, url: str, make_body: RequestFactory,
                  a: argparse.Namespace) -> dict[str, Any]:
    """Closed loop: each user first sends until one 2xx comes back (compiles, fetch processes start; untimed),
    then for `--warmup-s`; capacity = 2xx answers per second of that timed part. A 429 backs a user off 50 ms."""
    counts: Counter[str] = Counter()  # "class code"
    primed = time.perf_counter()

    ok_ms: list[float] = []

    async def user(until: float | None) -> int:
        num_ok = 0
        while (now := time.perf_counter()) < (until or float("inf")):
            out = await send(session, url, make_body()[0], a.timeout_s, now, now)
            counts[f"{out.cls} {out.reason}".strip()] += 1
            num_ok += out.cls == "2xx"
            if out.cls == "2xx" and until is not None:
                ok_ms.append(out.latency_s * 1e3)
            if out.cls != "2xx":
                await asyncio.sleep(0.05)
            elif until is None or out.cls == "lost":
                break
        return num_ok

    prime_start = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(user(None) for _ in range(a.warmup_concurrency))), a.timeout_s)
    primed = time.perf_counter()
    num_ok = sum(await asyncio.gather(*(user(primed + a.warmup_s) for _ in range(a.warmup_concurrency))))
    timed_s = time.perf_counter() - primed
    return {"concurrency": a.warmup_concurrency, "prime_s": primed - prime_start, "timed_s": timed_s,
            "by_class": dict(counts), "capacity_rps": num_ok / timed_s, "p50_ms": _percentile(ok_ms, 50),
            "p99_ms": _percentile(ok_ms, 99)}


async def soak(session: aiohttp.ClientSession, url: str, make_body: RequestFactory, rate: float,
               a: argparse.Namespace, sampler: Sampler) -> tuple[list[Outcome], dict[str, float]]:
    """Open loop: request i is due at t0 + i / rate, sent then whatever came back before."""
    outcomes: list[Outcome] = []
    inflight = [0, 0]  # now, max

    async def one(body: bytes, due: float) -> None:
        inflight[0] += 1
        inflight[1] = max(inflight)
        outcomes.append(await send(session, url, body, a.timeout_s, due, t0))
        inflight[0] -= 1

    t0 = sampler.t0 = time.perf_counter()
    sampler.phase = "soak"
    await sampler.sample()  # the post-warm-up baseline, at t = 0
    tasks, max_lag = [], 0.0
    for i in itertools.count():
        due = t0 + i / rate
        if due >= t0 + a.duration:
            break
        body = make_body()[0]
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        max_lag = max(max_lag, time.perf_counter() - due)
        tasks.append(asyncio.create_task(one(body, due)))
    sampler.phase = "drain"
    drain_start = time.perf_counter()
    await asyncio.gather(*tasks)
    return outcomes, {"send_lag_max_ms": max_lag * 1e3, "client_inflight_max": inflight[1],
                      "drain_s": time.perf_counter() - drain_start, "soak_end_t": drain_start - t0}


async def run_phases(url: str, a: argparse.Namespace, make_body: RequestFactory, probe: MemoryProbe,
                     ) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=a.max_connections, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        sampler = Sampler(session, url, probe, a.interval_s)
        sampling = asyncio.create_task(sampler.run())
        endpoint = url + "/v1/embeddings"
        warm = await warm_up(session, endpoint, make_body, a)
        rate = a.rate or a.overload * warm["capacity_rps"]
        if rate <= 0:
            sampling.cancel()
            raise RuntimeError(f"no 2xx answer in the warm-up ({warm['by_class']}), so no capacity to overload; "
                               "see the server log, or give --rate")
        outcomes, client = await soak(session, endpoint, make_body, rate, a, sampler)
        await sampler.sample()  # after the drain
        sampling.cancel()
    for row in sampler.samples:
        row["t"] = round(row["t"] - sampler.t0, 3)
    return {"warmup": warm, "rate": rate, "outcomes": outcomes, "client": client, "samples": sampler.samples}


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def flatness(samples: list[dict[str, Any]], tol_pct: float, tol_mib: float) -> dict[str, dict[str, Any]]:
    """Per memory series (MiB): baseline (t = 0, after the warm-up), mid and end (medians of 3 samples at the
    soak's middle and end), max over soak and drain, slope over the soak's 2nd half. Verdict, with
    tol = max(tol_pct % of the baseline, tol_mib): `flat` (end - baseline <= tol), `plateau` (grew more, but
    end - mid <= tol: bounded, e.g. by the queue filling to the admission limit), else `growing`."""
    soak_rows = [s for s in samples if s["phase"] == "soak"]
    late = [s for s in samples if s["phase"] != "warmup"]
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(k for s in soak_rows for k in s["memory_mib"]):
        series = [(s["t"], s["memory_mib"][name]) for s in soak_rows if name in s["memory_mib"]]
        base, half = series[0][1], len(series) // 2
        mid = float(np.median([v for _, v in series[max(half - 1, 0):half + 2]]))
        end = float(np.median([v for _, v in series[-3:]]))
        second = series[half:]
        slope = (float(np.polyfit([t for t, _ in second], [v for _, v in second], 1)[0]) * 60
                 if len(second) >= 3 else None)
        growth, tol = end - base, max(tol_pct / 100 * base, tol_mib)
        verdict = "flat" if growth <= tol else "plateau" if end - mid <= tol else "growing"
        out[name] = {"start": round(base, 1), "mid": round(mid, 1), "end": round(end, 1),
                     "max": round(max(s["memory_mib"].get(name) or 0.0 for s in late), 1),
                     "growth_mib": round(growth, 1), "growth_pct": round(100 * growth / base, 1) if base else None,
                     "slope_mib_per_min_2nd_half": None if slope is None else round(slope, 1),
                     "verdict": verdict, "flat": verdict == "flat"}
    return out


def summarize(run: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    outcomes: list[Outcome] = run["outcomes"]
    by_class = {c: sum(o.cls == c for o in outcomes) for c in CLASSES}
    ok_ms = [o.latency_s * 1e3 for o in outcomes if o.cls == "2xx"]
    shed_ms = [o.latency_s * 1e3 for o in outcomes if o.cls in _SHED]
    depths = [s["queue_depth"] for s in run["samples"] if s["queue_depth"] is not None]
    per_second: dict[int, Counter[str]] = {}
    for o in outcomes:
        per_second.setdefault(int(o.due_s), Counter())[o.cls] += 1
    return {
        "sent": len(outcomes), "answered": len(outcomes) - by_class["lost"], "by_class": by_class,
        "lost": by_class["lost"], "codes": dict(Counter(f"{o.cls} {o.reason}" for o in outcomes if o.reason)),
        "missing_retry_after": sum(o.cls in _SHED and not o.has_retry_after for o in outcomes),
        "shed_fraction": (by_class["429"] + by_class["503"]) / len(outcomes) if outcomes else 0.0,
        "ok_rps": len(ok_ms) / a.duration,
        "goodput_vs_capacity": len(ok_ms) / a.duration / cap if (cap := run["warmup"]["capacity_rps"]) else None,
        "p50_ms": _percentile(ok_ms, 50), "p99_ms": _percentile(ok_ms, 99), "max_ms": max(ok_ms, default=None),
        "shed_p99_ms": _percentile(shed_ms, 99),
        "queue_depth_max": max(depths, default=None),
        "memory": flatness(run["samples"], a.flat_pct, a.flat_mib),
        "by_second": {t: dict(c) for t, c in sorted(per_second.items())},
    }


def _summary_line(a: argparse.Namespace, run: dict[str, Any], s: dict[str, Any], path: Path) -> str:
    c = s["by_class"]
    other = c["4xx"] + c["5xx"]
    memory = s["memory"]
    verdict = "flat"
    for kind in ("plateau", "growing"):
        grown = [f"{k} +{v['growth_mib']:.0f} MiB" for k, v in memory.items() if v["verdict"] == kind]
        verdict = f"{'GROWING' if kind == 'growing' else 'grew then plateaued'}: {', '.join(grown)}" if grown \
            else verdict
    total = memory.get("total_rss", {})
    overload = run["rate"] / run["warmup"]["capacity_rps"] if run["warmup"]["capacity_rps"] else float("nan")
    p50 = "n/a" if s["p50_ms"] is None else f"{s['p50_ms']:.0f}"
    p99 = "n/a" if s["p99_ms"] is None else f"{s['p99_ms']:.0f}"
    return (f"SUMMARY soak {a.duration:g} s at {run['rate']:.1f} req/s ({overload:.1f}x the warm-up's "
            f"{run['warmup']['capacity_rps']:.1f} req/s): {s['sent']} sent, 2xx {c['2xx']} / 429 {c['429']} / "
            f"503 {c['503']} / 504 {c['504']} / other {other}, lost {s['lost']}, Retry-After missing "
            f"{s['missing_retry_after']}; max queue {s['queue_depth_max']}; memory {verdict} (total RSS "
            f"{total.get('start', 0):.0f} -> {total.get('end', 0):.0f} MiB); 2xx {s['ok_rps']:.1f}/s "
            f"({s['goodput_vs_capacity'] or 0:.2f}x capacity), p50 {p50} ms p99 {p99} ms; "
            f"results in {path}")


def _run(a: argparse.Namespace, argv: list[str]) -> int:
    if a.duration <= 0 or a.warmup_s <= 0 or a.warmup_concurrency < 1 or (a.rate is not None and a.rate <= 0):
        raise ValueError("--duration, --warmup-s, --warmup-concurrency and --rate must be > 0")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # one socket per request in flight
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    out_dir = Path(a.out_dir)
    mix = ImageMix.parse(a.mix)
    # NOTE: the same seed gives the same images and order; the nonces make this run's bytes (and URLs) new,
    # or an embedding cache left by an earlier run would answer them and inflate the measured capacity.
    nonce_start = a.nonce_start if a.nonce_start is not None else time.time_ns() // 1000
    if a.url and (status := health_status(a.url.rstrip("/")))[0] != 200:  # before drawing images
        raise RuntimeError(f"{a.url}/health answered {status[0] or 'nothing'}: {status[1][:300]}")
    with ExitStack() as stack:
        server = None
        if a.start:
            server = ManagedServer("mmenc", ["encoder_server.cli", "serve"],
                                   ["--allow-private-urls", *shlex.split(a.server_args)], out_dir / f"{a.name}.log")
            stack.callback(server.stop)
            server.start()
        images = generate_images(mix, a.distinct, a.seed)
        media = None if a.as_data_uri else stack.enter_context(MediaServer(images))
        if server is not None:
            server.wait_healthy(a.startup_timeout_s)
        url = server.url if server else a.url.rstrip("/")
        status, text = health_status(url)
        if status != 200:
            raise RuntimeError(f"{url}/health answered {status or 'nothing'}: {text[:300]}")
        make_body = RequestFactory(mix, images, media, a.items_per_request, is_data_uri=a.as_data_uri,
                                   is_unique=True, encoding_format="base64", nonces=itertools.count(nonce_start),
                                   seed=a.seed)
        probe = MemoryProbe(server.proc.pid if server and server.proc else None)
        run = asyncio.run(run_phases(url, a, make_body, probe))
    return _report(a, argv, url, json_or_none(text), {**run, "nonce_start": nonce_start})


def _report(a: argparse.Namespace, argv: list[str], url: str, health: Any, run: dict[str, Any]) -> int:
    from bench.common import write_results
    from bench.soak_plot import plot

    s = summarize(run, a)
    payload = {"bench": "soak", "argv": argv, "url": url, "server_args": a.server_args, "health": health,
               "duration_s": a.duration, "mix": a.mix, "items_per_request": a.items_per_request,
               "timeout_s": a.timeout_s, "flat_rule": {"pct": a.flat_pct, "mib": a.flat_mib},
               "nonce_start": run["nonce_start"], "warmup": run["warmup"], "rate": run["rate"],
               "client": run["client"], **s, "samples": run["samples"]}
    path = write_results(a.name, a.out_dir, payload)
    title = (f"mmenc soak: {run['rate']:.1f} req/s for {a.duration:g} s, {s['sent']} sent, "
             f"{s['by_class']['429'] + s['by_class']['503']} shed, {s['lost']} lost")
    plot(run["samples"], path.with_suffix(".png"), title, run["client"]["soak_end_t"])
    for name, m in s["memory"].items():
        print(f"  {name:<16} {m['start']:>8.1f} -> {m['mid']:>8.1f} -> {m['end']:>8.1f} MiB (max {m['max']:.1f}, "
              f"{m['growth_mib']:+.1f} MiB, 2nd-half slope {m['slope_mib_per_min_2nd_half']} MiB/min): {m['verdict']}")
    print(_summary_line(a, run, s, path), flush=True)
    return 0 if s["lost"] == 0 and s["missing_retry_after"] == 0 and s["by_class"]["2xx"] > 0 else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = build_parser().parse_args(argv)
    try:
        return _run(a, argv)
    except (RuntimeError, ValueError) as e:
        print(f"mmenc bench soak: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
