"""API key and load shedding at the gateway: real server, real HTTP clients."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import aiohttp
import openai
import pytest

from tests.server_process import ServerProcess
from tests.test_server_e2e import jpeg

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--api-key", KEY, "--max-inflight-requests", "8", "--max-worker-items", "4",
                       "--allow-private-urls") as srv:
        yield srv


def _status(url: str, headers: dict[str, str] | None = None, body: bytes | None = None) -> int:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        return urllib.request.urlopen(req, timeout=30).status
    except urllib.error.HTTPError as e:
        return e.code


def test_api_key_guards_every_route_but_health(server) -> None:
    assert _status(server.url + "/health") == 200
    assert _status(server.url + "/v1/models") == 401
    assert _status(server.url + "/v1/models", {"Authorization": "Bearer wrong"}) == 401
    assert _status(server.url + "/v1/models", {"Authorization": f"Bearer {KEY}"}) == 200
    assert _status(server.url + "/v1/embeddings", body=b'{"input": "x"}') == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0).models.list().data


def test_two_hundred_concurrent_clients_all_get_an_answer(server) -> None:
    import base64

    uri = "data:image/jpeg;base64," + base64.b64encode(jpeg(64, 48, seed=5)).decode()

    async def one(session: aiohttp.ClientSession) -> tuple[int, str | None, str]:
        async with session.post(server.url + "/v1/embeddings", json={"input": [uri]},
                                headers={"Authorization": f"Bearer {KEY}"}) as r:
            body = await r.json()
            return r.status, r.headers.get("Retry-After"), body.get("error", {}).get("message", "")

    async def main() -> list[tuple[int, str | None, str]]:
        connector = aiohttp.TCPConnector(limit=0)  # 200 connections at once
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
            return await asyncio.gather(*(one(session) for _ in range(200)))

    answers = asyncio.run(main())
    assert len(answers) == 200  # none lost or reset (an exception would have failed gather)
    assert all(status == 200 or (status == 429 and retry == "1") for status, retry, _ in answers), answers
    # The worker admits --max-worker-items 4 at once, so at least the first 4 it sees are answered; how many
    # more fit depends on how fast this machine encodes while the rest arrive.
    assert sum(status == 200 for status, _, _ in answers) >= 4
    assert any(status == 429 for status, _, _ in answers)


def test_items_queued_on_a_worker_are_bounded(server) -> None:
    """4 slow items fill the worker (--max-worker-items 4): the next request is a 429, not a longer queue."""
    import threading

    from tests.media_server import MediaServer

    auth = {"Authorization": f"Bearer {KEY}"}
    with MediaServer({}) as media:
        slow = [media.url(f"/trickle?n=300&interval=0.01&i={i}") for i in range(4)]  # ~3 s each
        first: list[int] = []
        thread = threading.Thread(target=lambda: first.append(
            _status(server.url + "/v1/embeddings", auth, json.dumps({"input": slow}).encode())))
        thread.start()
        time.sleep(1.0)
        req = urllib.request.Request(server.url + "/v1/embeddings", data=json.dumps({"input": [slow[0]]}).encode(),
                                     headers={"Content-Type": "application/json", **auth})
        with pytest.raises(urllib.error.HTTPError) as busy:
            urllib.request.urlopen(req, timeout=30)
        thread.join(60)
    assert busy.value.code == 429 and busy.value.headers["Retry-After"] == "1"
    assert "encoder worker busy" in json.loads(busy.value.read())["error"]["message"]
    assert first == [415]  # the 4 queued items were answered (their bytes are not images)
