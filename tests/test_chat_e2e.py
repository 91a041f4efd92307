"""`/v1/chat/completions` and `/v1/completions` through a real `mmenc serve` (gateway + encoder worker + engine),
called with the official `openai` client and raw HTTP. Tiny random models: the text is noise, the shapes,
token counts, caching, streaming and errors are what is checked."""

from __future__ import annotations

import base64
import http.client
import json
import os
import signal
import threading
import time

import openai
import pytest

from tests.media_server import MediaServer
from tests.media_video import make_video
from tests.server_process import ServerProcess
from tests.test_media_e2e import wav
from tests.test_server_e2e import jpeg

FILES = {"/a.jpg": jpeg(112, 84, seed=1), "/b.jpg": jpeg(112, 84, seed=2), "/clip.mp4": make_video(24, 12),
         "/voice.wav": wav(2.0)}
MODEL = "mimo-v2-flash-tiny"


@pytest.fixture(scope="module")
def media():
    with MediaServer(FILES) as srv:
        yield srv


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--allow-private-urls", "--num-workers", "2", "--llm", "tiny") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _chat(client, content, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          **{"max_tokens": 6, "temperature": 0, **kw})


def test_text_only_chat(client) -> None:
    out = _chat(client, "Hello there")
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens <= 6
    # <|im_start|>user\n + 11 bytes + <|im_end|>\n + <|im_start|>assistant\n
    assert out.usage.prompt_tokens == 1 + 5 + 11 + 1 + 1 + 1 + 10


def test_image_and_text_use_the_image_token_count(client, server, media) -> None:
    status, emb = server.post("/v1/embeddings", {"input": [media.url("/a.jpg")]})
    image_tokens = emb["data"][0]["num_tokens"]
    text_only = _chat(client, [{"type": "text", "text": "Describe:"}]).usage.prompt_tokens
    out = _chat(client, [{"type": "text", "text": "Describe:"}, _image(media.url("/a.jpg"))])
    assert out.usage.prompt_tokens == text_only + image_tokens + 2  # pads + vision start/end


def test_greedy_chat_is_deterministic_and_two_images_differ(client, media) -> None:
    a = _chat(client, [_image(media.url("/a.jpg")), {"type": "text", "text": "?"}], max_tokens=8)
    again = _chat(client, [_image(media.url("/a.jpg")), {"type": "text", "text": "?"}], max_tokens=8)
    assert a.choices[0].message.content == again.choices[0].message.content
    two = _chat(client, [_image(media.url("/a.jpg")), _image(media.url("/b.jpg")), {"type": "text", "text": "?"}])
    assert two.usage.prompt_tokens > a.usage.prompt_tokens


def test_video_and_audio_parts(client, media) -> None:
    video = _chat(client, [{"type": "video_url", "video_url": {"url": media.url("/clip.mp4")}}])
    audio_b64 = base64.b64encode(FILES["/voice.wav"]).decode()
    audio = _chat(client, [{"type": "input_audio", "input_audio": {"data": audio_b64, "format": "wav"}},
                           {"type": "audio_url", "audio_url": {"url": media.url("/voice.wav")}}])
    assert video.usage.prompt_tokens > 20
    assert audio.usage.prompt_tokens >= 2 * 100  # 2 s of audio -> 100 tokens each


def test_prefix_cache_reuses_image_kv_and_never_shares_it_between_images(client, media) -> None:
    content = [_image(media.url("/b.jpg")), {"type": "text", "text": "What is in the picture? Answer briefly."}]
    first = _chat(client, content)
    second = _chat(client, content)
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens - 10
    media.add("/never-seen.jpg", jpeg(112, 84, seed=99))
    other = _chat(client, [_image(media.url("/never-seen.jpg")), content[1]])
    # the same text after another image: only the part before the first image pad may be reused
    assert other.usage.prompt_tokens_details.cached_tokens <= 1 + 5 + 1


def test_streaming_with_usage(client, media) -> None:
    stream = _chat(client, [_image(media.url("/a.jpg")), {"type": "text", "text": "hi"}], stream=True,
                   stream_options={"include_usage": True}, max_tokens=5)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 5


def test_completions_with_text_and_token_ids(client) -> None:
    text = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0)
    ids = client.completions.create(model=MODEL, prompt=[3 + ord(c) for c in "abc"], max_tokens=3, temperature=0)
    assert text.usage.prompt_tokens == ids.usage.prompt_tokens == 3
    assert text.choices[0].text == ids.choices[0].text


def test_stop_string_and_seeded_sampling(client) -> None:
    kw = {"temperature": 1.0, "seed": 7, "max_tokens": 12}
    a = _chat(client, "sample", **kw).choices[0].message.content
    b = _chat(client, "sample", **kw).choices[0].message.content
    assert a == b and len(a) > 2 and a[1:3] not in a[:2]  # seed 7 gives a reply we can cut inside
    stopped = _chat(client, "sample", stop=[a[1:3]], **kw)
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].message.content == a[:1]


def test_sixteen_concurrent_clients(client, media) -> None:
    results: list[object] = []

    def call(i: int) -> None:
        try:
            results.append(_chat(client, [_image(media.url("/a.jpg" if i % 2 else "/b.jpg")),
                                          {"type": "text", "text": f"request {i}"}]))
        except Exception as e:  # collected and reported below
            results.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(results) == 16 and all(not isinstance(r, Exception) for r in results), results


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 9}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [1]}, 400, "stop"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "ftp://x/y.jpg"}}]}]},
     403, "messages[0].content[0]"),
])
def test_bad_chat_requests(server, body, status, param) -> None:
    got, answer = server.post("/v1/chat/completions", body)
    assert got == status, answer
    assert answer["error"]["param"] == param


def test_unreachable_image_is_a_400_naming_it(server, media) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                      _image(media.url("/missing.jpg"))]}], "max_tokens": 2}
    status, answer = server.post("/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == "messages[0].content[1]"
    assert "404" in answer["error"]["message"]


def _wait_engine_running(server, predicate, timeout_s: float = 20.0) -> int:
    """Poll /health until the engine's request count (refreshed by its pings, every 2 s) satisfies `predicate`."""
    deadline = time.monotonic() + timeout_s
    while not predicate(running := server.get("/health")[1]["engine"]["running"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return running


def test_client_disconnect_mid_stream_aborts_the_request(server) -> None:
    assert _wait_engine_running(server, lambda n: n == 0) == 0  # what earlier tests left has drained
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"messages": [{"role": "user", "content": "long"}], "max_tokens": 3000, "stream": True,
            "temperature": 0, "ignore_eos": True}  # minutes of tokens on this CPU unless aborted
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")  # generation runs
    assert _wait_engine_running(server, lambda n: n == 1) == 1
    conn.close()  # the client goes away
    assert _wait_engine_running(server, lambda n: n == 0) == 0  # aborted long before its 3000 tokens


def test_worker_killed_mid_request_fails_cleanly_or_retries(server, client, media) -> None:
    _, health = server.get("/health")
    victim = health["workers"][0]["pid"]
    results: list[object] = []

    def call() -> None:
        try:
            results.append(_chat(client, [_image(media.url("/a.jpg")), {"type": "text", "text": "kill"}]))
        except openai.APIStatusError as e:
            results.append(e.status_code)

    thread = threading.Thread(target=call)
    thread.start()
    os.kill(victim, signal.SIGKILL)
    thread.join(120)
    assert len(results) == 1 and (results[0] in (503, 504) or hasattr(results[0], "choices")), results
    deadline = time.monotonic() + 60  # the fleet heals and chat keeps working
    while time.monotonic() < deadline:
        _, health = server.get("/health")
        if all(w["ready"] for w in health["workers"]):
            break
        time.sleep(0.5)
    assert _chat(client, [_image(media.url("/a.jpg")), {"type": "text", "text": "after"}]).usage.prompt_tokens > 0


def test_engine_killed_mid_request_is_a_503_and_the_engine_comes_back(server, client) -> None:
    _, health = server.get("/health")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"messages": [{"role": "user", "content": "a long answer please"}], "max_tokens": 3000, "stream": True,
            "ignore_eos": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")  # generating now
    os.kill(health["engine"]["pid"], signal.SIGKILL)
    rest = response.read().decode()  # the stream ends with an error event, then [DONE]; it does not hang
    conn.close()
    events = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: {")]
    assert events and events[-1]["error"]["code"] == "unavailable" and rest.rstrip().endswith("data: [DONE]")
    status, answer = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert status == 503 and answer["error"]["code"] == "unavailable"  # while it restarts: a clear 503
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not server.get("/health")[1]["engine"]["ready"]:
        time.sleep(0.5)
    assert _chat(client, "back?").usage.completion_tokens > 0


def test_overlapped_server_path_equals_offline_generation(server, client, media) -> None:
    """The server admits the prompt once sizes are known and injects the embedding later; the same prompt with
    the embedding given up front to an in-process LLM (same weights, same projection) must answer the same."""
    import torch

    from encoder_server.config import EngineArgs
    from engine_link.chat_tokenizer import ByteTokenizer, Turn, render_chat
    from engine_link.engine import LLM, Prompt, SamplingParams
    from engine_link.projector import Projector

    media.add("/fresh.jpg", jpeg(448, 336, seed=11))  # not cached yet: the text is prefilled while it encodes
    url = media.url("/fresh.jpg")
    served = _chat(client, [{"type": "text", "text": "Describe: "}, _image(url)], max_tokens=10)
    status, emb = server.post("/v1/embeddings", {"input": [url], "pooling": "none"})
    assert status == 200
    vision = torch.tensor(emb["data"][0]["embedding"], dtype=torch.float32)  # [tokens, 128]
    llm = LLM("tiny", **{**EngineArgs().overrides(), "device": "cpu"})
    tok = ByteTokenizer(llm.model_config.vocab_size)
    ids, runs = render_chat([Turn("user", ("Describe: ", 0))], {0: vision.shape[0]}, {0: "image"}, tok)
    projected = Projector(llm.model_config.hidden_size, llm.device, llm.dtype, llm.model_config.seed)("image", vision)
    offline = llm.generate([Prompt(ids, [(runs[0].start, projected)])],
                           SamplingParams(temperature=0, max_tokens=10, stop_token_ids=tok.eos_ids))[0]
    assert served.usage.prompt_tokens == len(ids)
    assert served.usage.completion_tokens == len(offline.token_ids)
    assert served.choices[0].message.content == tok.decode(offline.token_ids)
