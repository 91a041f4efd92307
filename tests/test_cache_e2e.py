"""Routing + shared-memory cache end to end: a 2-worker fleet on loopback."""

from __future__ import annotations

import base64
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.media_server import MediaServer
from tests.server_process import ServerProcess
from tests.test_server_e2e import jpeg

IMAGES = {f"/c{i}.jpg": jpeg(120 + 28 * i, 90, seed=100 + i) for i in range(8)}


@pytest.fixture(scope="module")
def media():
    with MediaServer(IMAGES) as srv:
        yield srv


def _counters(server: ServerProcess) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    out: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            out[key] = out.get(key, 0.0) + s.value
    return out


def _get(counters: dict, name: str, **labels: str) -> float:
    return sum(v for (n, lbl), v in counters.items() if n == name and all((k, v2) in lbl for k, v2 in labels.items()))


def _embed(server: ServerProcess, inputs: list, **extra) -> tuple[int, dict]:
    return server.post("/v1/embeddings", {"input": inputs, **extra})


@pytest.fixture(scope="module")
def fleet():
    with ServerProcess("--allow-private-urls", "--num-workers", "2") as srv:
        yield srv


def test_repeated_media_hits_the_cache_with_identical_embeddings(fleet, media) -> None:
    url = media.url("/c0.jpg")
    status, first = _embed(fleet, [url], pooling="none")
    assert status == 200 and "cache" not in first["data"][0]["timings_ms"]
    before = _counters(fleet)
    status, second = _embed(fleet, [url], pooling="none")
    after = _counters(fleet)
    assert status == 200 and "cache" in second["data"][0]["timings_ms"]  # answered from the cache
    np.testing.assert_array_equal(np.array(second["data"][0]["embedding"]), np.array(first["data"][0]["embedding"]))
    assert second["data"][0]["grid_thw"] == first["data"][0]["grid_thw"]
    assert _get(after, "mmenc_forwards_total") == _get(before, "mmenc_forwards_total")  # no forward
    assert _get(after, "mmenc_cache_lookups_total", result="hit") > _get(before, "mmenc_cache_lookups_total",
                                                                          result="hit")
    # The same bytes under another URL: a content-key hit after the download.
    media.add("/copy-of-c0.jpg", IMAGES["/c0.jpg"])
    status, third = _embed(fleet, [media.url("/copy-of-c0.jpg")])
    assert status == 200 and "cache" in third["data"][0]["timings_ms"] and "fetch" in third["data"][0]["timings_ms"]
    np.testing.assert_allclose(third["data"][0]["embedding"], np.mean(first["data"][0]["embedding"], axis=0),
                               atol=1e-6)


def _urls_on_both_workers(fleet: ServerProcess, media: MediaServer) -> list[str]:
    """Fresh media URLs whose route keys land on both workers of the fleet's ring (worker addresses are
    random socket paths, so which URL lands where differs from run to run)."""
    from cache.keys import route_key
    from cache.ring import Ring

    _, health = fleet.get("/health")
    ring = Ring([w["address"] for w in health["workers"]])
    chosen: dict[str, list[str]] = {}
    for i in range(64):
        media.add(f"/split{i}.jpg", jpeg(100 + 14 * (i % 5), 90, seed=300 + i))
        url = media.url(f"/split{i}.jpg")
        chosen.setdefault(ring.node_for(route_key(url=url)), []).append(url)
        if len(chosen) == 2 and all(len(v) >= 3 for v in chosen.values()):
            return [u for urls in chosen.values() for u in urls]
    pytest.fail(f"64 URLs did not reach both workers: {chosen}")


def test_same_media_goes_to_the_same_worker_and_requests_are_split(fleet, media) -> None:
    urls = _urls_on_both_workers(fleet, media)
    before = _counters(fleet)
    status, body = _embed(fleet, urls)  # one request, items spread over both workers by route key
    assert status == 200 and [d["index"] for d in body["data"]] == list(range(len(urls)))
    after = _counters(fleet)
    workers = {dict(lbl)["worker"] for (n, lbl), v in after.items()
               if n == "mmenc_forwards_total" and v > before.get((n, lbl), 0.0)}
    assert workers == {"worker-0", "worker-1"}
    # Repeating every URL is answered by the worker that encoded it: all hits, no new forward.
    status, again = _embed(fleet, urls)
    final = _counters(fleet)
    assert all("cache" in d["timings_ms"] for d in again["data"])
    assert _get(final, "mmenc_forwards_total") == _get(after, "mmenc_forwards_total")
    for a, b in zip(body["data"], again["data"], strict=True):
        np.testing.assert_allclose(a["embedding"], b["embedding"], atol=1e-6)


def test_uuid_skips_the_download(fleet, media) -> None:
    part = {"type": "image_url", "image_url": {"url": media.url("/c3.jpg")}, "uuid": "photo-3"}
    status, first = _embed(fleet, [part])
    assert status == 200
    requests_before = len(media.requests)
    status, second = _embed(fleet, [{"type": "image_url", "uuid": "photo-3"}])  # no url at all
    assert status == 200 and len(media.requests) == requests_before
    np.testing.assert_allclose(second["data"][0]["embedding"], first["data"][0]["embedding"], atol=1e-6)
    status, body = _embed(fleet, [{"type": "image_url", "uuid": "never-seen"}])
    assert status == 400 and body["error"]["code"] == "cache_miss" and "never-seen" in body["error"]["message"]
    status, body = _embed(fleet, [{"type": "image_url", "uuid": 42}])
    assert status == 400 and "uuid" in body["error"]["message"]


def test_inline_bytes_are_cached_by_their_hash(fleet) -> None:
    uri = "data:image/jpeg;base64," + base64.b64encode(jpeg(200, 150, seed=7)).decode()
    status, first = _embed(fleet, [uri])
    status, second = _embed(fleet, [uri])
    assert status == 200 and "cache" in second["data"][0]["timings_ms"]
    np.testing.assert_allclose(second["data"][0]["embedding"], first["data"][0]["embedding"], atol=1e-6)


def test_restarted_fleet_starts_warm(media) -> None:
    url = media.url("/c5.jpg")
    first = ServerProcess("--allow-private-urls").start()
    try:
        status, cold = _embed(first, [url])
        assert status == 200 and "cache" not in cold["data"][0]["timings_ms"]
    finally:
        first.stop(keep_cache=True)
    with ServerProcess("--allow-private-urls", cache_name=first.cache_name) as second:
        status, warm = _embed(second, [url])
        assert status == 200 and "cache" in warm["data"][0]["timings_ms"]
        np.testing.assert_allclose(warm["data"][0]["embedding"], cold["data"][0]["embedding"], atol=1e-6)


def test_cache_cli_stats_and_clear(fleet, media) -> None:
    import json
    import subprocess
    import sys

    from tests.server_process import REPO

    _embed(fleet, [media.url("/c6.jpg")])

    def mmenc(*args: str) -> str:
        result = subprocess.run([sys.executable, "-m", "encoder_server.cli", "cache", *args, "--name",
                                 fleet.cache_name], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout

    stats = json.loads(mmenc("stats"))
    assert stats["name"] == fleet.cache_name and stats["entries"] > 0 and stats["hits"] > 0
    assert "cleared" in mmenc("clear")
    assert json.loads(mmenc("stats"))["entries"] == 0
    status, body = _embed(fleet, [media.url("/c6.jpg")])
    assert status == 200 and "cache" not in body["data"][0]["timings_ms"]


def test_bounded_loads_spill_a_burst_past_its_owner(fleet, media) -> None:
    """24 new images whose keys all belong to one worker, in one request: with --route-balance 1.25 (default)
    the owner keeps at most 1.25 x the mean + 4 of them (19), its ring successor takes the rest."""
    from cache.keys import route_key
    from cache.ring import Ring

    _, health = fleet.get("/health")
    ring = Ring([w["address"] for w in health["workers"]])
    owner = None
    urls: list[str] = []
    for i in range(400):
        media.add(f"/burst{i}.jpg", jpeg(64, 48, seed=900 + i))
        url = media.url(f"/burst{i}.jpg")
        node = ring.node_for(route_key(url=url))
        owner = owner or node
        if node == owner:
            urls.append(url)
        if len(urls) == 24:
            break
    before = _counters(fleet)
    status, body = _embed(fleet, urls)
    after = _counters(fleet)
    assert status == 200 and len(body["data"]) == 24
    spilled = _get(after, "mmenc_route_spills_total") - _get(before, "mmenc_route_spills_total")
    loads: dict[str, int] = {}
    for url in urls:  # the gateway's rule, nothing in flight before the request
        node = ring.node_within_bound(route_key(url=url), loads, 1.25, 4)
        loads[node] = loads.get(node, 0) + 1
    assert loads[owner] == 19 and spilled == 24 - loads[owner] == 5
    workers = {dict(lbl)["worker"] for (n, lbl), v in after.items()
               if n == "mmenc_forwards_total" and v > before.get((n, lbl), 0.0)}
    assert workers == {"worker-0", "worker-1"}


def test_bench_serve_open_loop_against_this_fleet(fleet, tmp_path) -> None:
    """`mmenc bench serve --url` (open loop) against this running 2-worker fleet: per-worker balance rows."""
    from tests.test_bench_serve import _check_row, _run

    result = _run(tmp_path, "--url", fleet.url, "--rate", "8", "--duration", "2", "--items-per-request", "2",
                  "--as-data-uri", "--metrics-interval-s", "0.5")
    (row,) = result["rows"]
    _check_row(row)
    assert row["mode"] == "open" and row["rate"] == 8
    assert row["img_s"] == pytest.approx(2 * row["rps"])
    assert result["baseline"] is None and result["ratio"] is None
    # Per-worker balance: unique bytes hash over both workers; their forwards add up to the fleet's.
    workers = row["workers"]
    assert [w["worker"] for w in workers] == ["worker-0", "worker-1"]
    assert all(w["forwards"] > 0 and 0 < w["item_share"] < 1 for w in workers)
    assert sum(w["forwards"] for w in workers) == row["forwards"]
    assert sum(w["item_share"] for w in workers) == pytest.approx(1.0)
    assert row["starved_fraction"] is not None and 0 <= row["starved_fraction"] <= 1
