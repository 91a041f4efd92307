"""A fleet of CPU workers behind one gateway: batching across requests, restarts, metrics."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.media_server import MediaServer
from tests.server_process import ServerProcess
from tests.test_server_e2e import jpeg

IMAGES = {f"/{i}.jpg": jpeg(64 + 28 * (i % 4), 96 + 14 * (i % 3), seed=i) for i in range(24)}


@pytest.fixture(scope="module")
def media():
    with MediaServer(IMAGES) as srv:
        yield srv


@pytest.fixture(scope="module")
def fleet():
    with ServerProcess("--allow-private-urls", "--num-workers", "2", "--max-wait-ms", "20") as srv:
        yield srv


def _metrics(server: ServerProcess) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f"|{k}={v}" for k, v in sorted(sample.labels.items()))
            values[key] = values.get(key, 0.0) + sample.value
    return values


def _total(values: dict[str, float], name: str) -> float:
    return sum(v for k, v in values.items() if k.split("|")[0] == name)


def _embed(server: ServerProcess, urls: list[str]) -> tuple[int, dict]:
    return server.post("/v1/embeddings", {"input": urls})


def test_workers_are_named_and_addressable(fleet) -> None:
    status, body = fleet.get("/health")
    assert status == 200 and len(body["workers"]) == 2
    for i, worker in enumerate(body["workers"]):
        assert worker["ready"] and worker["address"].endswith(f"worker-{i}")
        with open(f"/proc/{worker['pid']}/comm") as f:
            assert f.read().strip() == f"mmenc-worker-{i}"


def test_concurrent_requests_share_forwards_and_match_solo_encoding(fleet, media) -> None:
    urls = [media.url(p) for p in IMAGES]
    solo = {}
    for url in urls[:4]:
        status, body = _embed(fleet, [url])
        assert status == 200, body
        solo[url] = np.array(body["data"][0]["embedding"])
    before = _metrics(fleet)
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda u: _embed(fleet, [u, urls[0]]), urls))
    after = _metrics(fleet)
    assert all(status == 200 for status, _ in results)
    num_items = 2 * len(urls)
    forwards = _total(after, "mmenc_forwards_total") - _total(before, "mmenc_forwards_total")
    assert 0 < forwards < num_items, (forwards, num_items)  # items from different requests shared forwards
    assert _total(after, "mmenc_forward_items_count") - _total(before, "mmenc_forward_items_count") == forwards
    for (_, body), url in zip(results, urls, strict=True):
        if url in solo:
            np.testing.assert_allclose(body["data"][0]["embedding"], solo[url], atol=1e-5)
        np.testing.assert_allclose(body["data"][1]["embedding"], solo[urls[0]], atol=1e-5)
    per_worker = {k: v for k, v in after.items() if k.startswith("mmenc_forwards_total")}
    assert len(per_worker) == 2  # both workers took part


def test_metrics_expose_stages_queue_and_errors(fleet, media) -> None:
    status, _ = _embed(fleet, [media.url("/missing.jpg")])
    assert status == 400
    values = _metrics(fleet)
    for stage in ("fetch", "decode", "queue", "preprocess", "encode", "publish"):
        assert values.get(f"mmenc_stage_seconds_count|stage={stage}", 0) > 0, stage
    assert values.get("mmenc_errors_total|code=fetch_failed", 0) >= 1
    assert any(k.startswith("mmenc_queue_depth") for k in values)
    assert _total(values, "mmenc_encode_busy_seconds_total") > 0
    assert values.get("mmenc_requests_total|route=/v1/embeddings|status=200", 0) > 0


def test_killed_worker_is_restarted_and_requests_keep_working(fleet, media) -> None:
    urls = [media.url(p) for p in IMAGES]
    _, health = fleet.get("/health")
    victim = health["workers"][0]["pid"]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_embed, fleet, [u]) for u in urls]
        os.kill(victim, signal.SIGKILL)
        outcomes = [f.result(timeout=60) for f in futures]
    # Every request got an answer: encoded (perhaps retried on the other worker) or a clear 503.
    for status, body in outcomes:
        assert status == 200 or (status == 503 and body["error"]["code"] == "unavailable"), body
    assert sum(status == 200 for status, _ in outcomes) >= len(urls) // 2
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status, health = fleet.get("/health")
        pids = [w["pid"] for w in health["workers"]]
        if all(w["ready"] for w in health["workers"]) and victim not in pids:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"worker not restarted: {health}")
    assert _total(_metrics(fleet), "mmenc_worker_restarts_total") >= 1
    status, body = _embed(fleet, urls[:3])
    assert status == 200 and len(body["data"]) == 3
