"""The server on a GPU: nvjpeg decode, compiled bf16 ViT, same embeddings as the CPU fp32 path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.media_server import MediaServer
from tests.server_process import ServerProcess
from tests.test_server_e2e import jpeg, png

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_gpu_server_matches_cpu_server() -> None:
    images = {"/a.jpg": jpeg(640, 480, 1), "/b.jpg": jpeg(1920, 1080, 2), "/c.png": png(100, 300)}
    with MediaServer(images) as media:
        urls = [media.url(p) for p in images]
        results = {}
        for device in ("cuda", "cpu"):
            with ServerProcess("--allow-private-urls", "--device", device, startup_timeout_s=300) as srv:
                status, body = srv.post("/v1/embeddings", {"input": urls})
                assert status == 200, body
                results[device] = np.array([d["embedding"] for d in body["data"]])
                assert [d["grid_thw"] for d in body["data"]] == [[1, 34, 46], [1, 52, 94], [1, 22, 8]]
    gpu, cpu = results["cuda"], results["cpu"]
    relative = np.linalg.norm(gpu - cpu, axis=1) / np.linalg.norm(cpu, axis=1)
    # bf16 + nvjpeg (a different IDCT than libjpeg) against fp32 + PIL: close, not equal.
    assert (relative < 0.05).all(), relative
