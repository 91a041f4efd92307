"""The encoder link against real worker processes: sizes then embeddings pushed to the receiver, retries on
the next ring node, per-item deadlines, per-item errors. Real ZeroMQ over loopback TCP."""

from __future__ import annotations

import queue
import time

import numpy as np
import pytest

from cache.keys import route_key
from encoder_server import messages as m
from engine_link.link import EncoderLink, ItemEvent, LinkConfig
from tests.media_server import MediaServer
from tests.server_process import ServerProcess, free_port
from tests.test_server_e2e import jpeg

IMAGES = {f"/l{i}.jpg": jpeg(80 + 28 * i, 60, seed=40 + i) for i in range(4)}


@pytest.fixture(scope="module")
def media():
    with MediaServer(IMAGES) as srv:
        yield srv


@pytest.fixture(scope="module")
def server():
    port = free_port()
    with ServerProcess("--allow-private-urls", "--worker-port", str(port)) as srv:
        srv.worker_address = f"tcp://127.0.0.1:{port}"
        yield srv


def _item(index: int, url: str) -> m.EncodeItem:
    return m.EncodeItem(index, "image", url, route_key=route_key(url=url))


def _collect(link: EncoderLink, request_id: str, num_items: int, timeout_s: float = 60.0) -> list[ItemEvent]:
    """Events of one request until every item has its final event."""
    events: list[ItemEvent] = []
    deadline = time.monotonic() + timeout_s
    while sum(e.kind != "sized" for e in events) < num_items:
        try:
            event = link.events.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            pytest.fail(f"only {events} after {timeout_s} s")
        if event.request_id == request_id:
            events.append(event)
    return events


def test_sizes_then_embeddings_equal_the_http_answer(server, media) -> None:
    urls = [media.url(p) for p in IMAGES]
    link = EncoderLink([server.worker_address])
    try:
        link.submit("r1", [_item(i, u) for i, u in enumerate(urls)])
        events = _collect(link, "r1", len(urls))
    finally:
        link.close()
    for i in range(len(urls)):
        mine = [e for e in events if e.index == i]
        assert [e.kind for e in mine] == ["sized", "embedding"]  # the size comes first
        sized, done = mine
        assert sized.num_tokens == done.num_tokens == done.embedding.shape[0] and sized.grid_thw == done.grid_thw
    status, body = server.post("/v1/embeddings", {"input": urls, "pooling": "none"})
    assert status == 200
    for i, data in enumerate(body["data"]):
        got = next(e for e in events if e.index == i and e.kind == "embedding").embedding.numpy()
        np.testing.assert_allclose(got, np.array(data["embedding"]), atol=1e-6)


def test_a_bad_item_fails_alone_with_its_reason(server, media) -> None:
    link = EncoderLink([server.worker_address])
    try:
        link.submit("r2", [_item(0, media.url("/l0.jpg")), _item(1, media.url("/missing.jpg"))])
        events = _collect(link, "r2", 2)
    finally:
        link.close()
    final = {e.index: e for e in events if e.kind != "sized"}
    assert final[0].kind == "embedding"
    assert final[1].kind == "error" and final[1].error_code == "fetch_failed" and "404" in final[1].error_message


def test_unreachable_worker_is_skipped_for_the_next_ring_node(server, media) -> None:
    urls = [media.url(p) for p in IMAGES]
    for _ in range(50):  # a dead address (nothing listens there) that the ring gives some of the urls
        dead = f"tcp://127.0.0.1:{free_port()}"
        link = EncoderLink([dead, server.worker_address], cfg=LinkConfig(accept_timeout_s=0.5))
        if {link._ring.node_for(route_key(url=u)) for u in urls} == {dead, server.worker_address}:
            break
        link.close()
    else:
        pytest.fail("no port split the urls over both ring nodes")
    try:
        link.submit("r3", [_item(i, u) for i, u in enumerate(urls)])
        events = _collect(link, "r3", len(urls))
    finally:
        link.close()
    assert sorted(e.index for e in events if e.kind == "embedding") == list(range(len(urls)))


def test_no_worker_answers_fails_every_item_fast() -> None:
    link = EncoderLink([f"tcp://127.0.0.1:{free_port()}"], cfg=LinkConfig(accept_timeout_s=0.3))
    try:
        start = time.monotonic()
        link.submit("r4", [_item(0, "http://127.0.0.1:9/x.jpg")])
        (event,) = _collect(link, "r4", 1, timeout_s=10)
    finally:
        link.close()
    assert event.kind == "error" and event.error_code == "unavailable" and event.error_status == 503
    assert time.monotonic() - start < 5


def test_item_deadline(server, media) -> None:
    link = EncoderLink([server.worker_address], cfg=LinkConfig(item_timeout_s=0.5))
    try:
        url = media.url("/trickle?n=100&interval=0.05")  # 100 bytes over 5 s
        link.submit("r5", [_item(0, url)])
        events = _collect(link, "r5", 1, timeout_s=10)
    finally:
        link.close()
    final = [e for e in events if e.kind != "sized"]
    assert len(final) == 1 and final[0].kind == "error" and final[0].error_code == "timeout"


@pytest.mark.parametrize("balance, owner_keeps", [(1.25, 19), (0.0, 24)])
def test_a_burst_owned_by_one_worker_spills_like_the_gateway(balance: float, owner_keeps: int) -> None:
    """24 items whose keys one worker owns: with bounded loads the owner keeps 1.25 x the mean + 4 (19) and the
    rest go to its ring successor, as the gateway routes; --route-balance 0 keeps the strict ring."""
    from cache.ring import Ring

    nodes = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]  # nothing answers: groups stay unaccepted
    owner = Ring(nodes).node_for(route_key(url="http://media/0.jpg"))
    urls = [u for u in (f"http://media/{i}.jpg" for i in range(400))
            if Ring(nodes).node_for(route_key(url=u)) == owner][:24]
    link = EncoderLink(nodes, cfg=LinkConfig(accept_timeout_s=60, route_balance=balance))
    try:
        link.submit("burst", [_item(i, u) for i, u in enumerate(urls)])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                groups = list(link._groups.values())  # NOTE: the IO thread's dict; retried if it changes under us
            except RuntimeError:
                continue
            if sum(len(g.items) for g in groups) == 24:
                break
            time.sleep(0.01)
        per_node = {g.node: len(g.items) for g in groups}
    finally:
        link.close()
    assert per_node[owner] == owner_keeps and sum(per_node.values()) == 24
