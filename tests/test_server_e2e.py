"""End to end: a real `mmenc serve` process on loopback, called over HTTP and with the `openai` client."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import urllib.request

import numpy as np
import pytest
import torch
from PIL import Image

from encoder_server.config import PreprocessConfig
from encoder_server.models.loader import load_vision
from preprocess.decode import decode_images
from preprocess.image import preprocess_images
from tests.media_server import MediaServer
from tests.server_process import ServerProcess

DIM = 128  # tiny preset out_hidden_size


def jpeg(width: int, height: int, seed: int = 0, quality: int = 90) -> bytes:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 // max(width, 1), yy * 255 // max(height, 1), (xx + yy) % 256], -1)
    pixels = np.clip(base + rng.integers(0, 40, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def png(width: int, height: int, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (width, height), 120).save(buf, "PNG")
    return buf.getvalue()


def data_uri(blob: bytes, mime: str = "image/jpeg") -> str:
    return f"data:{mime};base64," + base64.b64encode(blob).decode()


IMAGES = {"/a.jpg": jpeg(320, 240, 1), "/b.jpg": jpeg(97, 333, 2), "/c.png": png(64, 64),
          "/text.jpg": b"this is not an image", "/trunc.jpg": jpeg(320, 240, 3)[:2000],
          "/bomb.png": png(12000, 12000, "1"), "/thin.png": png(500, 2)}


@pytest.fixture(scope="module")
def media():
    with MediaServer(IMAGES) as srv:
        yield srv


@pytest.fixture(scope="module")
def local_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "local.jpg").write_bytes(IMAGES["/a.jpg"])
    return d


@pytest.fixture(scope="module")
def server(local_dir):
    flags = ["--allow-private-urls", "--allowed-local-media-dir", str(local_dir), "--fetch-timeout-s", "1",
             "--max-download-bytes", "3000000", "--max-items-per-request", "8", "--max-source-pixels", "50000000",
             "--max-body-bytes", "5000000"]
    with ServerProcess(*flags) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference():
    """In-process encoder with the server's defaults: tiny preset, fp32, CPU."""
    model = load_vision("tiny", torch.device("cpu"), torch.float32).model
    cfg = PreprocessConfig()

    def encode(blob: bytes) -> np.ndarray:
        image = decode_images([blob], "pil", "cpu")[0]
        batch = preprocess_images([image], cfg, torch.device("cpu"))
        with torch.inference_mode():
            return model(batch.pixel_values, batch.grid_thw).numpy()  # [tokens, D]

    return encode


def _embed(server: ServerProcess, inputs, **extra):
    return server.post("/v1/embeddings", {"input": inputs, "model": "mmenc-vision", **extra})


def test_health_and_models(server) -> None:
    status, body = server.get("/health")
    assert status == 200 and body["workers"][0]["ready"]
    status, body = server.get("/v1/models")
    assert status == 200 and body["data"][0]["id"] == "mmenc-vision"


def test_url_embedding_equals_in_process_encoding(server, media, reference) -> None:
    status, body = _embed(server, media.url("/a.jpg"))
    assert status == 200, body
    item = body["data"][0]
    expected = reference(IMAGES["/a.jpg"])
    np.testing.assert_allclose(item["embedding"], expected.mean(0), atol=1e-5)
    assert item["num_tokens"] == expected.shape[0] == body["usage"]["prompt_tokens"]
    assert item["grid_thw"] == [1, 18, 22]  # 240x320 -> smart_resize 252x308 -> 18x22 patches
    assert set(item["timings_ms"]) >= {"fetch", "decode", "queue", "preprocess", "encode"}


def test_mixed_sources_keep_order(server, media, local_dir, reference) -> None:
    inputs = [
        {"type": "image_url", "image_url": {"url": media.url("/b.jpg")}},
        data_uri(IMAGES["/c.png"], "image/png"),
        f"file://{local_dir / 'local.jpg'}",
        media.url("/a.jpg"),
    ]
    status, body = _embed(server, inputs)
    assert status == 200, body
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    for d, blob in zip(body["data"], [IMAGES["/b.jpg"], IMAGES["/c.png"], IMAGES["/a.jpg"], IMAGES["/a.jpg"]],
                       strict=True):
        np.testing.assert_allclose(d["embedding"], reference(blob).mean(0), atol=1e-5)


def test_per_token_embeddings_float_and_base64(server, media, reference) -> None:
    expected = reference(IMAGES["/b.jpg"])  # [tokens, D]
    status, body = _embed(server, media.url("/b.jpg"), pooling="none")
    assert status == 200, body
    tokens = np.array(body["data"][0]["embedding"])
    assert tokens.shape == expected.shape == tuple(body["data"][0]["shape"])
    np.testing.assert_allclose(tokens, expected, atol=1e-5)
    status, body = _embed(server, media.url("/b.jpg"), pooling="none", encoding_format="base64")
    raw = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(raw.reshape(body["data"][0]["shape"]), expected, atol=1e-5)


def test_large_float_answer_is_streamed_as_it_is_formatted(server, media, reference) -> None:
    """Two 1280x960 images, every token, as floats: more values than STREAM_VALUES, so the body goes out in
    chunks between event-loop turns (json_splice.pieces); it parses to the same numbers."""
    big = jpeg(1280, 960, 7)
    media.add("/big.jpg", big)
    req = urllib.request.Request(server.url + "/v1/embeddings", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"input": [media.url("/big.jpg")] * 2, "pooling": "none"}).encode())
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.headers.get("Transfer-Encoding") == "chunked"
        body = json.loads(resp.read())
    expected = reference(big)  # [tokens, D]
    assert sum(np.size(d["embedding"]) for d in body["data"]) > 1 << 18
    for d in body["data"]:
        np.testing.assert_allclose(np.array(d["embedding"]), expected, atol=1e-5)


def test_client_leaving_a_streamed_answer_is_not_an_error(server, media) -> None:
    import http.client
    import time

    media.add("/big.jpg", jpeg(1280, 960, 7))  # the streamed test's image: a cache hit when it ran first
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/embeddings", body=json.dumps({"input": [media.url("/big.jpg")] * 2,
                                                             "pooling": "none"}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and len(resp.read(1000)) == 1000
    conn.close()  # mid-answer
    deadline = time.monotonic() + 20
    while "went away during a streamed answer" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "went away during a streamed answer" in server.log()
    assert "unhandled error" not in server.log()
    assert server.get("/health")[0] == 200


def test_openai_client(server, media, reference) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    result = client.embeddings.create(model="mmenc-vision", input=[media.url("/a.jpg"), media.url("/b.jpg")])
    assert [len(d.embedding) for d in result.data] == [DIM, DIM]
    np.testing.assert_allclose(result.data[1].embedding, reference(IMAGES["/b.jpg"]).mean(0), atol=1e-5)
    floats = client.embeddings.create(model="mmenc-vision", input=media.url("/a.jpg"), encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, result.data[0].embedding, atol=1e-6)
    assert result.usage.prompt_tokens > 0
    assert [m.id for m in client.models.list().data] == ["mmenc-vision"]


@pytest.mark.parametrize("source, status, code, words", [
    ("/text.jpg", 415, "undecodable_media", "image"),
    ("/trunc.jpg", 415, "undecodable_media", "truncated"),
    ("/bomb.png", 413, "media_too_large", "12000x12000"),
    ("/thin.png", 400, "bad_aspect_ratio", "aspect ratio"),
    ("/status/404", 400, "fetch_failed", "404"),
    ("/stall", 400, "fetch_failed", "timed out"),
    ("/big?size=5000000", 413, "media_too_large", "limit"),
])
def test_bad_media_fails_its_item_only(server, media, source, status, code, words) -> None:
    """A bad item beside a good one: 4xx naming index 1; a concurrent good request is unaffected."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        bad = pool.submit(_embed, server, [media.url("/a.jpg"), media.url(source)])
        good = pool.submit(_embed, server, [media.url("/b.jpg")])
        (bad_status, bad_body), (good_status, good_body) = bad.result(), good.result()
    assert bad_status == status, bad_body
    err = bad_body["error"]
    assert err["param"] == "input[1]" and err["code"] == code
    assert err["message"].startswith("input[1]:") and words.lower() in err["message"].lower(), err
    assert good_status == 200 and len(good_body["data"]) == 1


@pytest.mark.parametrize("inputs, status, param, words", [
    ("ftp://example.com/a.jpg", 403, "input[0]", "scheme"),
    (["data:image/png;base64,@@not-base64@@"], 400, "input[0]", "base64"),
    ([{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}], 403, "input[0]", "outside"),
    ([{"type": "text", "text": "hello"}], 400, "input[0]", "not supported"),
    ([], 400, "input", "empty"),
    (["data:,x"] * 9, 400, "input", "limit"),
    ([[1, 2, 3]], 400, "input[0]", "token"),
])
def test_bad_requests_are_refused_at_the_gateway(server, inputs, status, param, words) -> None:
    code, body = _embed(server, inputs)
    assert code == status, body
    assert body["error"]["param"] == param and words in body["error"]["message"], body


def test_malformed_bodies(server) -> None:
    assert server.post("/v1/embeddings", None, raw=b"")[0] == 400
    status, body = server.post("/v1/embeddings", None, raw=b"{not json")
    assert status == 400 and "JSON" in body["error"]["message"]
    status, body = server.post("/v1/embeddings", {"no_input": 1})
    assert status == 400 and body["error"]["param"] == "input"
    status, body = server.post("/v1/embeddings", None, raw=b"[" + b"1," * 3_000_000 + b"1]")
    assert status == 413, body
    status, body = server.post("/v1/embeddings", None, raw=b"[" * 100_000)  # would overflow Python's parser stack
    assert status == 400 and "nested too deeply" in body["error"]["message"]
    status, body = _embed(server, "data:,x", encoding_format="hex")
    assert status == 400 and body["error"]["param"] == "encoding_format"
    status, body = server.get("/v1/nope")
    assert status == 404 and "error" in body


def test_server_still_healthy_after_bad_input(server, media) -> None:
    status, body = _embed(server, media.url("/c.png"))
    assert status == 200 and len(body["data"][0]["embedding"]) == DIM


def test_private_urls_refused_by_default(media) -> None:
    """Without --allow-private-urls the loopback origin and metadata addresses are refused, before any traffic."""
    with ServerProcess() as srv:
        before = len(media.requests)
        for url, param in [(media.url("/a.jpg"), "input[0]"), ("http://169.254.169.254/latest/meta-data", "input[0]")]:
            status, body = srv.post("/v1/embeddings", {"input": url})
            assert status == 403 and body["error"]["param"] == param, body
        status, body = srv.post("/v1/embeddings", {"input": "http://localhost:1/x.jpg"})
        assert status == 403, body
        assert len(media.requests) == before
