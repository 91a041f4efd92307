"""Remote fleets: `mmenc serve --worker-port P` on one side, `--encoders host:P` on the other."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.media_server import MediaServer
from tests.server_process import ServerProcess, free_port
from tests.test_server_e2e import jpeg

IMAGES = {f"/r{i}.jpg": jpeg(150, 100 + 14 * i, seed=200 + i) for i in range(6)}


@pytest.fixture(scope="module")
def media():
    with MediaServer(IMAGES) as srv:
        yield srv


def _wait_ready(server: ServerProcess, count: int, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, health = server.get("/health")
        if sum(w["ready"] for w in health["workers"]) == count:
            return health
        time.sleep(0.2)
    pytest.fail(f"expected {count} ready workers: {health}")


def test_gateway_with_only_remote_workers_and_a_mixed_ring(media) -> None:
    worker_port = free_port()
    urls = [media.url(p) for p in IMAGES]
    with ServerProcess("--allow-private-urls", "--num-workers", "1", "--worker-port", str(worker_port)) as remote:
        status, direct = remote.post("/v1/embeddings", {"input": urls})
        assert status == 200
        # One local worker plus the remote one on the same ring (--route-balance 0: each URL to its ring owner);
        # the answers equal the remote server's own, and the remote leaves the ring when it goes away.
        # (A gateway with only remote workers is what every --api-processes front is: tests/test_api_fronts.py.)
        mixed = ServerProcess("--allow-private-urls", "--num-workers", "1", "--route-balance", "0", "--encoders",
                              f"127.0.0.1:{worker_port}").start()
        try:
            health = _wait_ready(mixed, 2)
            assert {w["address"] for w in health["workers"]} >= {f"tcp://127.0.0.1:{worker_port}"}
            status, body = mixed.post("/v1/embeddings", {"input": urls})
            assert status == 200 and len(body["data"]) == len(urls)
            for a, b in zip(direct["data"], body["data"], strict=True):
                np.testing.assert_allclose(a["embedding"], b["embedding"], atol=1e-6)
            remote.stop()
            _wait_ready(mixed, 1)
            status, body = mixed.post("/v1/embeddings", {"input": urls})
            assert status == 200 and len(body["data"]) == len(urls)  # the ring healed onto the local worker
        finally:
            mixed.stop()


def test_bad_encoders_flag_is_a_clear_error() -> None:
    import subprocess
    import sys

    from tests.server_process import REPO

    result = subprocess.run([sys.executable, "-m", "encoder_server.cli", "serve", "--num-workers", "0"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--encoders" in result.stderr
    result = subprocess.run([sys.executable, "-m", "encoder_server.cli", "serve", "--encoders", "nohost"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "host:port" in result.stderr
