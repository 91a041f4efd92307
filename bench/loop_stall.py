"""`mmenc bench loop-stall`: how long one large answer holds the gateway's event loop.

Starts `mmenc serve` with `--server-args`, sends one request for `--images` 1080p JPEGs with `pooling: "none"`
and `--encoding-format` (every token's embedding), and meanwhile asks `/health` every `--interval-ms` on its
own connection. A gateway that formats the answer in one go leaves `/health` waiting for all of it; one that
writes it between event-loop turns answers `/health` within a block. Prints the big request's time and the
`/health` latencies seen while it ran (p50, max).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from bench.media import ImageMix, MediaServer, generate_images
from bench.procs import ManagedServer


def _health_poller(url: str, interval_s: float, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        urllib.request.urlopen(url + "/health", timeout=60).read()
        out.append((time.perf_counter() - start) * 1e3)
        time.sleep(interval_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mmenc bench loop-stall", description=__doc__.split("\n\n")[0])
    p.add_argument("--server-args", default="--device cpu --llm none --cache-bytes 0")
    p.add_argument("--images", type=int, default=2)
    p.add_argument("--encoding-format", default="float", choices=["float", "base64"])
    p.add_argument("--interval-ms", type=float, default=20.0)
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    a = p.parse_args(argv)
    images = generate_images(ImageMix.parse("1080p"), a.images)
    log = Path(tempfile.gettempdir()) / "mmenc-loop-stall.log"
    server = ManagedServer("mmenc", ["encoder_server.cli", "serve"], ["--allow-private-urls",
                                                                      *shlex.split(a.server_args)], log)
    with MediaServer(images) as media:
        server.start()
        try:
            server.wait_healthy(a.startup_timeout_s)
            label = next(iter(images))
            body = json.dumps({"input": [media.url(label, i) for i in range(a.images)], "pooling": "none",
                               "encoding_format": a.encoding_format}).encode()
            req = urllib.request.Request(server.url + "/v1/embeddings", data=body,
                                         headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=600).read()  # warm-up (and the fetch, decode, forward path)
            latencies: list[float] = []
            stop = threading.Event()
            poller = threading.Thread(target=_health_poller, args=(server.url, a.interval_ms / 1e3, stop, latencies))
            poller.start()
            time.sleep(0.2)
            start = time.perf_counter()
            size = len(urllib.request.urlopen(req, timeout=600).read())
            big_ms = (time.perf_counter() - start) * 1e3
            stop.set()
            poller.join()
        finally:
            server.stop()
    print(f"one request, {a.images} x 1080p, pooling none, {a.encoding_format}: {big_ms:.0f} ms, {size / 1e6:.1f} MB; "
          f"/health meanwhile: p50 {np.percentile(latencies, 50):.1f} ms, max {max(latencies):.1f} ms "
          f"({len(latencies)} probes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
