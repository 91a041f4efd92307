"""`mmenc bench video-serve`: video through `/v1/embeddings` end to end (fetch + decode + preprocess + encode).

Two figures, one run, against a started (`--server-args`) or running (`--url`) server:
1. latency of one long video (default: the 1-hour 720p30 H.264 of `bench.media_make`, 768 sampled frames),
   with the server's per-stage timings (fetch, decode, queue, preprocess, encode), `--long-repeats` times;
2. videos/s and latency p50/p99 for a mix of short clips (distinct 640x360 H.264 clips) with closed-loop
   clients at each `--concurrency`.
A started server runs with `--cache-bytes 0` unless told otherwise, so every request is decoded and encoded.
Media comes from a local HTTP server on loopback.
"""

from __future__ import annotations

import argparse
import http.server
import json
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import environment, markdown_table, write_results
from bench.media_make import DEFAULT_MEDIA_DIR, VideoSpec, encode_clip, make_video
from bench.procs import ManagedServer


class _Media(http.server.ThreadingHTTPServer):
    """Serves `files` (path -> bytes) on loopback; query strings are ignored (they only make URLs distinct)."""

    def __init__(self, files: dict[str, bytes]) -> None:
        files_ = files

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                body = files_.get(self.path.split("?")[0])
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

        super().__init__(("127.0.0.1", 0), Handler)
        self.daemon_threads = True
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"


def _embed_video(server_url: str, video_url: str, timeout_s: float, **options: Any) -> tuple[float, dict]:
    body = json.dumps({"input": [{"type": "video_url", "video_url": {"url": video_url, **options}}]}).encode()
    req = urllib.request.Request(server_url + "/v1/embeddings", body, {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        answer = json.loads(r.read())
    return time.perf_counter() - start, answer["data"][0]


def _percentiles(values: list[float]) -> dict[str, float]:
    return {"p50_ms": float(np.percentile(values, 50)) * 1e3, "p99_ms": float(np.percentile(values, 99)) * 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mmenc bench video-serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="", help="a running server (default: start one with --server-args)")
    p.add_argument("--server-args", default="--vision-model qwen2.5-vl-7b --dtype bfloat16 --llm none",
                   help="flags for the started server (--cache-bytes 0 is added unless present)")
    p.add_argument("--long-video", default="", help="a video file (default: made by bench.media_make)")
    p.add_argument("--long-duration", type=float, default=3600.0, help="seconds of the made long video (0: skip)")
    p.add_argument("--long-width", type=int, default=1280)
    p.add_argument("--long-height", type=int, default=720)
    p.add_argument("--long-nframes", type=int, default=768, help="frames sampled from the long video")
    p.add_argument("--long-repeats", type=int, default=2)
    p.add_argument("--clips", type=int, default=16, help="distinct short clips")
    p.add_argument("--clip-seconds", type=float, default=10.0)
    p.add_argument("--clip-size", default="640x360")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per concurrency level")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--media-dir", default=str(DEFAULT_MEDIA_DIR))
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--name", default="video_serve")
    a = p.parse_args(argv)

    width, height = (int(x) for x in a.clip_size.split("x"))
    clip_frames = max(2, round(a.clip_seconds * 30))
    files = {f"/clip{i}.mp4": encode_clip(clip_frames, width, height, 30, gop=30, crf=28 + i % 5)
             for i in range(a.clips)}
    long_path = Path(a.long_video) if a.long_video else None
    if long_path is None and a.long_duration > 0:
        long_path = make_video(VideoSpec(duration_s=a.long_duration, width=a.long_width, height=a.long_height,
                                         clip_s=min(60.0, a.long_duration)), a.media_dir)
    if long_path is not None:
        files["/long.mp4"] = long_path.read_bytes()
    media = _Media(files)
    server = None
    if not a.url:
        args = a.server_args.split()
        args += [] if "--cache-bytes" in args else ["--cache-bytes", "0"]
        server = ManagedServer("mmenc", ["encoder_server.cli", "serve"], ["--allow-private-urls", *args],
                               Path(a.out_dir) / f"{a.name}.log").start()
        server.wait_healthy(900)
    url = a.url or server.url
    results: dict[str, Any] = {"bench": "video_serve", "argv": argv if argv is not None else sys.argv[1:],
                               "env": environment(torch.device("cpu")), "long": [], "clips": []}
    try:
        _embed_video(url, media.url("/clip0.mp4?warmup"), a.timeout)  # compile / first-request costs
        for r in range(a.long_repeats if long_path is not None else 0):
            seconds, data = _embed_video(url, media.url(f"/long.mp4?r={r}"), a.timeout, nframes=a.long_nframes)
            results["long"].append({"seconds": seconds, "num_tokens": data["num_tokens"], "grid_thw": data["grid_thw"],
                                    "timings_ms": data["timings_ms"]})
            print(f"long video: {seconds:.2f} s, {data['num_tokens']} tokens, {data['timings_ms']}", flush=True)
        for c in (int(x) for x in a.concurrency.split(",")):
            latencies: list[float] = []
            stop_at = time.monotonic() + a.duration
            counter = iter(range(10**9))

            def client(stop_at: float = stop_at, latencies: list[float] = latencies, counter=counter) -> None:
                while time.monotonic() < stop_at:
                    i = next(counter)
                    seconds, _ = _embed_video(url, media.url(f"/clip{i % a.clips}.mp4?n={i}"), a.timeout)
                    latencies.append(seconds)

            start = time.monotonic()
            with ThreadPoolExecutor(c) as pool:
                list(pool.map(lambda _: client(), range(c)))
            elapsed = time.monotonic() - start
            row = {"concurrency": c, "videos": len(latencies), "videos_s": len(latencies) / elapsed,
                   **_percentiles(latencies)}
            results["clips"].append(row)
            print(row, flush=True)
    finally:
        if server is not None:
            server.stop()
        media.shutdown()
    long_s = min((r["seconds"] for r in results["long"]), default=float("nan"))
    best = max(results["clips"], key=lambda r: r["videos_s"])
    print(markdown_table(results["clips"], ["concurrency", "videos", "videos_s", "p50_ms", "p99_ms"]))
    path = write_results(a.name, a.out_dir, results)
    print(f"SUMMARY video-serve: long video {long_s:.2f} s end to end ({a.long_nframes} frames sampled); "
          f"{a.clip_seconds:g} s {a.clip_size} clips {best['videos_s']:.2f} videos/s at c={best['concurrency']} "
          f"(p50 {best['p50_ms']:.0f} ms); results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
