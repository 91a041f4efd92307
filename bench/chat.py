"""`mmenc bench chat`: TTFT and throughput of streamed image+text chats on `/v1/chat/completions`, overlapped
streaming (`--llm-overlap`) vs encode-then-prefill (`--no-llm-overlap`), cache-cold vs cache-warm, at several
concurrencies, all in one run.

One `mmenc serve` per mode starts here (same flags otherwise, each with a fresh embedding-cache arena of its
own, removed at the end); the images come from a local media server (`bench/media.py`). Closed loop: N users,
each sends its next chat when its previous stream ended. Each chat is `--prompt-words` random words, then
`--images-per-request` images (text first, so the overlap path has text to prefill while the images
encode), `--max-tokens` tokens at temperature 0, streamed with a final usage chunk.

- cold: every image is new. Its bytes carry a fresh nonce (a JPEG comment, in the URL too), so neither the
  encoder cache (keyed by URL and by content hash) nor the engine prefix cache (image runs keyed by the
  content key) has seen it; the words are drawn per request, so only the chat template's first tokens repeat.
- warm: `--warm-set` fixed chats, sent once untimed, then repeated: encoder cache and prefix cache hits.

The points interleave the modes (for each cache state and concurrency, one mode after the other), so a
drift in the machine's load hits both. Each server gets an untimed warm-up first (`--warmup-requests` cold
chats at the highest concurrency). TTFT = time to the first SSE event.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp

from bench.chat_report import ChatRecord, cache_lookups, ratios, summarize, summary_line, tables
from bench.loadgen import CLIENT_FAILURES, Progress, failure_code, get_text, json_or_none
from bench.media import ImageMix, MediaServer, generate_images
from bench.procs import ManagedServer, health_status

MODES = {"overlap": "--llm-overlap", "encode-then-prefill": "--no-llm-overlap"}
CACHES = ("cold", "warm")
WORDS = ("photo image scene picture light color shape object person animal street building sky water tree car "
         "table window door road city field river mountain shadow corner center left right top bottom small "
         "large bright dark red green blue yellow white black round square near far behind front inside "
         "outside above below describe explain count list compare what where which how many").split()
ChatFactory = Callable[[], tuple[bytes, int]]  # -> (JSON body, number of images)


def _names(choices: tuple[str, ...] | dict[str, str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [x for x in text.split(",") if x]
        if not names or any(n not in choices for n in names):
            raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated subset of {', '.join(choices)}")
        return names
    return parse


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmenc bench chat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llm", default="mid", help="engine model of both servers: tiny | mid | DIR")
    p.add_argument("--vision-model", default="qwen2.5-vl-7b", help="encoder of both servers: tiny | qwen2.5-vl-7b")
    p.add_argument("--llm-kv-tokens", type=int, default=131072,
                   help="engine KV pool of both servers (the serve default, 16384, queues 32 users' 2K-token chats)")
    p.add_argument("--server-args", default="", help="more flags for both servers, one string "
                   "(e.g. '--device cpu --cache-bytes 67108864'; a single flag: --server-args='--flag')")
    p.add_argument("--modes", type=_names(MODES), default=list(MODES), help="overlap,encode-then-prefill")
    p.add_argument("--caches", type=_names(CACHES), default=list(CACHES), help="cold,warm")
    p.add_argument("--concurrency", type=_ints, default=[1, 8, 32], help="closed-loop users per point (1,8,32)")
    p.add_argument("--duration", type=float, default=20.0, help="timed seconds per point")
    p.add_argument("--mix", default="1080p", help="image sizes: 448 | 1080p | 4k | mixed | WxH | size=weight,...")
    p.add_argument("--images-per-request", type=int, default=1)
    p.add_argument("--prompt-words", type=int, default=100, help="random words before the images")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--warm-set", type=int, default=8, help="distinct chats repeated in the warm state")
    p.add_argument("--distinct", type=int, default=16, help="base images per size (cold chats add a nonce)")
    p.add_argument("--warmup-requests", type=int, help="untimed chats per server first (default 2 x peak users)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="client timeout per request")
    p.add_argument("--startup-timeout-s", type=float, default=900.0, help="wait for /health and the engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--name", default="chat")
    return p


# ----------------------------------------------------------------------------------------------- requests
def _body(a: argparse.Namespace, text: str, urls: list[str]) -> bytes:
    content = [{"type": "text", "text": text}, *({"type": "image_url", "image_url": {"url": u}} for u in urls)]
    return json.dumps({"model": "bench", "messages": [{"role": "user", "content": content}],
                       "max_tokens": a.max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()


def cold_chats(a: argparse.Namespace, mix: ImageMix, media: MediaServer, nonces: Iterator[int],
               key: str) -> ChatFactory:
    """Chats no cache has seen: fresh words and fresh image bytes (a nonce from the run-wide counter) each.
    The same `key` gives the same words and base images in the same order (so both modes get the same work)."""
    rng = random.Random(f"{a.seed}-{key}")
    next_index = dict.fromkeys(mix.labels, 0)

    def make() -> tuple[bytes, int]:
        urls = []
        for _ in range(a.images_per_request):
            label = rng.choices(mix.labels, mix.weights)[0]
            index, next_index[label] = next_index[label], (next_index[label] + 1) % a.distinct
            urls.append(media.url(f"cold-{label}", index, next(nonces)))
        return _body(a, " ".join(rng.choices(WORDS, k=a.prompt_words)), urls), len(urls)
    return make


def warm_chats(a: argparse.Namespace, mix: ImageMix, media: MediaServer) -> list[bytes]:
    """The `--warm-set` fixed chats: each its own words and its own images (plain URLs, no nonce)."""
    rng = random.Random(f"{a.seed}-warm")
    bodies = []
    for k in range(a.warm_set):
        labels = rng.choices(mix.labels, mix.weights, k=a.images_per_request)
        urls = [media.url(f"warm-{label}", k * a.images_per_request + j) for j, label in enumerate(labels)]
        bodies.append(_body(a, " ".join(rng.choices(WORDS, k=a.prompt_words)), urls))
    return bodies


def repeat(bodies: list[bytes], num_images: int) -> ChatFactory:
    cycle = itertools.cycle(bodies)
    return lambda: (next(cycle), num_images)


# ----------------------------------------------------------------------------------------------- load
def _error_code(status: int, raw: bytes) -> str:
    body = json_or_none(raw.decode(errors="replace"))
    code = body.get("error", {}).get("code") if isinstance(body, dict) and isinstance(body.get("error"), dict) else None
    return str(code) if code else f"http_{status}"


async def stream_chat(session: aiohttp.ClientSession, url: str, body: bytes, num_images: int,
                      timeout_s: float) -> ChatRecord:
    """POST one streaming chat; TTFT at its first SSE event, usage from its last chunk. Never raises for
    network, HTTP or stream errors (an `error` event, or a stream without usage, is a failed request)."""
    start = time.perf_counter()
    rec = ChatRecord(0.0, None, 0, None, num_images)
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            rec.status = resp.status
            if resp.status != 200:
                rec.code = _error_code(resp.status, await resp.read())
            else:
                has_usage = False
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    if rec.ttft_s is None:
                        rec.ttft_s = time.perf_counter() - start
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        rec.code = str((event["error"] or {}).get("code") or "stream_error")
                    if usage := event.get("usage"):
                        has_usage = True
                        rec.prompt_tokens, rec.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
                        rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                if rec.code is None and not has_usage:
                    rec.code = "no_usage"
    except (*CLIENT_FAILURES, AttributeError) as e:
        rec.code = failure_code(e)
    rec.end_at = time.perf_counter()
    rec.latency_s = rec.end_at - start
    return rec


async def closed_loop(session: aiohttp.ClientSession, url: str, concurrency: int, make: ChatFactory,
                      timeout_s: float, progress: Progress, duration_s: float = math.inf,
                      num_requests: float = math.inf) -> tuple[list[ChatRecord], float]:
    """`concurrency` users until `duration_s` passed or `num_requests` were sent; (records, start to last end)."""
    start = time.perf_counter()
    deadline = start + duration_s
    records: list[ChatRecord] = []
    issued = 0

    async def user() -> None:
        nonlocal issued
        while time.perf_counter() < deadline and issued < num_requests:
            issued += 1
            body, num_images = make()
            progress.num_in_flight += 1
            rec = await stream_chat(session, url, body, num_images, timeout_s)
            progress.num_in_flight -= 1
            progress.record(rec)  # type: ignore[arg-type]
            records.append(rec)

    await asyncio.gather(*(user() for _ in range(concurrency)))
    return records, max((r.end_at for r in records), default=time.perf_counter()) - start


async def _warm_up(session: aiohttp.ClientSession, url: str, label: str, concurrency: int, num_requests: int,
                   make: ChatFactory, timeout_s: float) -> None:
    """Untimed chats; how long they took and their failures go to stderr, not into any row."""
    records, wall_s = await closed_loop(session, url, concurrency, make, timeout_s, Progress(label, enabled=False),
                                        num_requests=num_requests)
    failed = Counter(f"{r.status} {r.code}" for r in records if not r.ok)
    print(f"{label}: {len(records)} chats in {wall_s:.1f} s, {sum(failed.values())} failed {dict(failed) or ''}",
          file=sys.stderr, flush=True)


def _one_line(row: dict[str, Any]) -> str:
    def fmt(key: str, spec: str = ".0f") -> str:
        return "n/a" if row.get(key) is None else format(row[key], spec)

    return (f"{row['mode']} {row['cache']} c={row['concurrency']}: {row['ok']} ok, {row['errors']} errors, "
            f"TTFT p50 {fmt('ttft_p50_ms')} / p99 {fmt('ttft_p99_ms')} ms, e2e p50 {fmt('e2e_p50_ms')} ms, "
            f"{fmt('out_tok_s', '.1f')} out tok/s, cached {fmt('cached_tokens', '.1f')}/{fmt('prompt_tokens')} "
            f"tokens, encoder cache hits/image {fmt('enc_cache_hit_rate', '.2f')}")


async def run_points(a: argparse.Namespace, urls: dict[str, str], mix: ImageMix, media: MediaServer) -> list[dict]:
    nonces = itertools.count()
    warm = warm_chats(a, mix, media)
    peak = max(a.concurrency)
    rows = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max(peak, a.warm_set) + 4)) as session:
        for mode, url in urls.items():
            await _warm_up(session, url + "/v1/chat/completions", f"{mode} warm-up", peak,
                           a.warmup_requests or max(4, 2 * peak), cold_chats(a, mix, media, nonces, "warm-up"),
                           a.timeout_s)
        for cache in a.caches:
            if cache == "warm":  # every chat of the set once, so that the timed phase finds them cached
                for mode, url in urls.items():
                    await _warm_up(session, url + "/v1/chat/completions", f"{mode} warm set", a.warm_set,
                                   a.warm_set, repeat(warm, a.images_per_request), a.timeout_s)
            for c in a.concurrency:
                for mode, url in urls.items():
                    make = (cold_chats(a, mix, media, nonces, f"{cache}-{c}") if cache == "cold"
                            else repeat(warm, a.images_per_request))
                    before = cache_lookups((await get_text(session, url + "/metrics"))[1])
                    with Progress(f"{mode} {cache} c={c}", enabled=not a.no_progress) as progress:
                        records, wall_s = await closed_loop(session, url + "/v1/chat/completions", c, make,
                                                            a.timeout_s, progress, duration_s=a.duration)
                    after = cache_lookups((await get_text(session, url + "/metrics"))[1])
                    rows.append({"mode": mode, "cache": cache, "concurrency": c,
                                 **summarize(records, wall_s, before, after)})
                    print(_one_line(rows[-1]), flush=True)
    return rows


# ----------------------------------------------------------------------------------------------- servers
def _wait_engine(server: ManagedServer, timeout_s: float) -> dict[str, Any]:
    """/health once the engine is ready too (its body); RuntimeError with the log's tail otherwise."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, text = health_status(server.url)
        health = json_or_none(text) or {}
        if status == 200 and (health.get("engine") or {}).get("ready"):
            return health
        time.sleep(0.25)
    raise RuntimeError(f"{server.name}: the engine is not ready after {timeout_s:.0f} s "
                       f"(is --llm none?); log {server.log_path}:\n{server.log_tail()}")


def _shut_down(servers: list[ManagedServer], arenas: list[str]) -> None:
    """Stop the servers side by side (each shuts down gracefully, which takes seconds), then remove the
    embedding-cache arenas they made for this run."""
    from cache.shm import ShmEmbeddingCache

    with ThreadPoolExecutor(max(len(servers), 1)) as pool:
        list(pool.map(ManagedServer.stop, servers))
    for name in arenas:
        if ShmEmbeddingCache.exists(name):
            ShmEmbeddingCache(name, 0, create=False).unlink()


def _check(a: argparse.Namespace, extra: list[str]) -> None:
    if any(x.split("=")[0] in ("--llm-overlap", "--no-llm-overlap") for x in extra):
        raise ValueError("--server-args must not set --llm-overlap / --no-llm-overlap: the modes do")
    if min(a.concurrency, default=0) < 1 or a.duration <= 0:
        raise ValueError("--concurrency values and --duration must be > 0")
    if min(a.images_per_request, a.prompt_words, a.max_tokens, a.warm_set, a.distinct) < 1:
        raise ValueError("--images-per-request, --prompt-words, --max-tokens, --warm-set, --distinct must be >= 1")


def _run(a: argparse.Namespace, argv: list[str]) -> int:
    start = time.perf_counter()
    extra = shlex.split(a.server_args)
    _check(a, extra)
    mix = ImageMix.parse(a.mix)
    out_dir = Path(a.out_dir)
    servers: dict[str, ManagedServer] = {}
    with ExitStack() as stack:
        started: list[ManagedServer] = []
        arenas: list[str] = []
        stack.callback(_shut_down, started, arenas)
        for mode in a.modes:  # start all, then generate the images while they load
            arena = [] if any(x.startswith("--cache-name") for x in extra) else [
                "--cache-name", f"mmenc-bench-chat-{os.getpid()}-{mode}"]
            arenas += arena[1:]
            args = ["--allow-private-urls", "--llm", a.llm, "--vision-model", a.vision_model,
                    "--llm-kv-tokens", str(a.llm_kv_tokens), MODES[mode], *arena, *extra]
            servers[mode] = ManagedServer(mode, ["encoder_server.cli", "serve"], args,
                                          out_dir / f"{a.name}.{mode}.log")
            started.append(servers[mode].start())
        cold = generate_images(mix, a.distinct, a.seed)
        warm = generate_images(mix, a.warm_set * a.images_per_request, a.seed + 1)
        images = {**{f"cold-{k}": v for k, v in cold.items()}, **{f"warm-{k}": v for k, v in warm.items()}}
        media = stack.enter_context(MediaServer(images))
        health: dict[str, Any] = {}
        for mode, server in servers.items():
            server.wait_healthy(a.startup_timeout_s)
            health[mode] = _wait_engine(server, a.startup_timeout_s)
        rows = asyncio.run(run_points(a, {mode: s.url for mode, s in servers.items()}, mix, media))
    info = {mode: {"argv": s.argv[1:], "startup_s": s.startup_s, "health": health[mode]}
            for mode, s in servers.items()}
    return _report(a, argv, mix, rows, info, time.perf_counter() - start)


def _report(a: argparse.Namespace, argv: list[str], mix: ImageMix, rows: list[dict[str, Any]],
            servers: dict[str, Any], total_s: float) -> int:
    import torch

    from bench.common import environment, write_results

    mode, baseline = "overlap", "encode-then-prefill"  # with one mode only, the mode ratios are empty
    ratio = ratios(rows, mode, baseline)
    payload = {
        "bench": "chat", "llm": a.llm, "vision_model": a.vision_model, "llm_kv_tokens": a.llm_kv_tokens,
        "server_args": a.server_args,
        "modes": a.modes, "caches": a.caches, "concurrency": a.concurrency, "duration_s": a.duration,
        "mix": mix.describe(), "images_per_request": a.images_per_request, "prompt_words": a.prompt_words,
        "max_tokens": a.max_tokens, "warm_set": a.warm_set, "distinct": a.distinct,
        "warmup_requests": a.warmup_requests or max(4, 2 * max(a.concurrency)), "seed": a.seed,
        "servers": servers, "total_s": total_s,
        "env": environment(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),  # the servers inherit it (CPU runs: say how many)
        "argv": argv, "rows": rows, "ratios": ratio,
    }
    path = write_results(a.name, a.out_dir, payload)
    print(tables(rows, ratio[f"{mode}_vs_{baseline}"]))
    label = f"{a.mix} x{a.images_per_request} + {a.prompt_words} words, llm {a.llm}, vision {a.vision_model}"
    print(summary_line(label, rows, ratio, mode, baseline, str(path)), flush=True)
    return 0 if all(r["ok"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = build_parser().parse_args(argv)
    try:
        return _run(a, argv)
    except (RuntimeError, ValueError) as e:  # failed startup, bad flags: one clear message
        print(f"mmenc bench chat: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
