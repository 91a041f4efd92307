"""Graceful shutdown: SIGTERM stops accepting, lets in-flight requests finish, and leaves no shared memory
behind but the (deliberately persistent) embedding cache arena."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from tests.media_server import MediaServer
from tests.server_process import ServerProcess
from tests.test_server_e2e import jpeg


def test_sigterm_finishes_in_flight_requests_and_frees_shared_memory() -> None:
    image = jpeg(96, 64, seed=9)
    with MediaServer({"/x.jpg": image}) as media:
        server = ServerProcess("--allow-private-urls").start()
        _, health = server.get("/health")
        worker_pid = health["workers"][0]["pid"]
        assert any(p.name.startswith(f"mmenc-fetch-{0}-{worker_pid}") for p in Path("/dev/shm").iterdir())
        results: list[int] = []
        # 600 bytes arriving over ~3 s: in flight when SIGTERM comes
        slow = media.url("/trickle?n=600&interval=0.005")
        thread = threading.Thread(target=lambda: results.append(server.post("/v1/embeddings", {"input": [slow]})[0]))
        thread.start()
        time.sleep(1.0)
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)
        thread.join(60)
        server.proc.wait(60)
        # the request was answered (its bytes are not an image: 415), not dropped
        assert results == [415]
        leftovers = [p.name for p in Path("/dev/shm").iterdir() if f"-{worker_pid}-" in p.name]
        assert leftovers == []
        server.stop()  # removes the test's cache arena
