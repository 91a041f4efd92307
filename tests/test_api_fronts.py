"""`--api-processes 2`: two HTTP processes on one port (SO_REUSEPORT), both serving embeddings and chat over the
same workers and engine; a killed front is restarted while the other keeps answering."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import time
import urllib.request
from collections import Counter

import pytest

from encoder_server.api_fronts import share
from encoder_server.config import ServerArgs
from tests.server_process import ServerProcess
from tests.test_server_e2e import jpeg

pytestmark = pytest.mark.timeout(180)

IMAGE = "data:image/jpeg;base64," + base64.b64encode(jpeg(96, 64, seed=11)).decode()


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--api-processes", "2", "--llm", "tiny", "--max-worker-items", "7") as srv:
        yield srv


def test_both_fronts_serve_embeddings_and_chat_alike(server) -> None:
    fronts = Counter(server.get("/health")[1]["api_process"] for _ in range(24))
    assert set(fronts) == {0, 1}, fronts  # 24 new connections: both listening processes get some
    embeddings = [server.post("/v1/embeddings", {"input": [IMAGE]}) for _ in range(8)]
    assert all(status == 200 for status, _ in embeddings)
    assert len({tuple(answer["data"][0]["embedding"]) for _, answer in embeddings}) == 1  # same worker
    chat = {"model": "mimo-v2-flash-tiny", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE}},
                                                      {"type": "text", "text": "what is it?"}]}]}
    replies = [server.post("/v1/chat/completions", chat) for _ in range(8)]
    assert all(status == 200 for status, _ in replies), replies
    assert len({answer["choices"][0]["message"]["content"] for _, answer in replies}) == 1  # greedy: one answer
    _, health = server.get("/health")
    assert health["engine"]["ready"] and all(w["ready"] for w in health["workers"])


def test_a_killed_front_is_restarted_and_the_other_keeps_answering(server) -> None:
    pid = int(subprocess.check_output(["pgrep", "-P", str(server.proc.pid), "-x", "mmenc-api-1"]).split()[0])
    os.kill(pid, signal.SIGKILL)
    # NOTE: a connection the kernel queued on the dying listener is reset (SO_REUSEPORT); once the supervisor has
    # seen the exit, new connections go to the live front only.
    deadline = time.monotonic() + 10
    while "mmenc-api-1 exited" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    answered = [server.post("/v1/embeddings", {"input": [IMAGE]})[0] for _ in range(6)]
    assert answered == [200] * 6
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if 1 in {server.get("/health")[1]["api_process"] for _ in range(8)}:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"mmenc-api-1 did not come back:\n{server.log()[-3000:]}")
    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    assert 'mmenc_worker_restarts_total{worker="api-1"} 1.0' in text


def test_each_front_enforces_its_share_of_the_bounds() -> None:
    args = share(ServerArgs(api_processes=3, port=8000, max_inflight_requests=512, max_worker_items=7))
    assert (args.max_inflight_requests, args.max_worker_items) == (171, 3)  # rounded up: 3 x 3 >= 7
    with pytest.raises(ValueError, match="fixed --port"):
        ServerArgs(api_processes=2, port=0)
    with pytest.raises(ValueError, match="1..64"):
        ServerArgs(api_processes=0)
