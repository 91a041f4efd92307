"""Video and audio through a real server: `video_url`, `audio_url` and `input_audio` parts of `/v1/embeddings`.

Each embedding is checked against encoding the same media directly in this process (same sampling, same
preprocessing, same seeded tiny encoders); bad media fail alone with a 4xx naming the item.
"""

from __future__ import annotations

import base64
import io
import threading
import wave

import numpy as np
import pytest
import torch

from encoder_server.config import PreprocessConfig
from encoder_server.encode_inputs import audio_window_tokens
from encoder_server.models.audio import load_audio
from encoder_server.models.loader import load_vision
from encoder_server.video_options import sampling_for
from preprocess.audio import decode_audio
from preprocess.mel import log_mel_long
from preprocess.video import preprocess_video
from preprocess.video_decode import decode_frames, probe_video
from preprocess.video_sampling import sample_indices
from tests.media_server import MediaServer
from tests.media_video import make_video
from tests.server_process import ServerProcess
from tests.test_server_e2e import jpeg

VIDEO = make_video(num_frames=48, fps=24, width=64, height=48, gop=12)  # 2 s
LONG_VIDEO = make_video(num_frames=70, fps=1, width=32, height=32, gop=10)  # 70 s, above the server's limit


def wav(seconds: float, sr: int = 16000, channels: int = 1, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    x = 0.3 * np.sin(2 * np.pi * (220 + 40 * rng.random()) * t) + 0.05 * rng.standard_normal(t.size)
    pcm = (np.clip(np.repeat(x[:, None], channels, 1), -1, 1) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(sr)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


SHORT_WAV = wav(3.0, sr=22050, channels=2)
LONG_WAV = wav(35.0)  # two 30 s windows


@pytest.fixture(scope="module")
def media():
    files = {"/clip.mp4": VIDEO, "/long.mp4": LONG_VIDEO, "/broken.mp4": VIDEO[: len(VIDEO) // 3] + b"\0" * 500,
             "/empty.mp4": b"", "/noise.mp4": np.random.default_rng(1).bytes(4000), "/short.wav": SHORT_WAV,
             "/long.wav": LONG_WAV, "/img.jpg": jpeg(96, 64, seed=3), "/too-long.wav": wav(61.0, sr=8000)}
    with MediaServer(files) as srv:
        yield srv


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--allow-private-urls", "--max-video-duration-s", "60", "--max-audio-duration-s", "60") as srv:
        yield srv


def _embed(server: ServerProcess, inputs: list, **extra) -> tuple[int, dict]:
    return server.post("/v1/embeddings", {"input": inputs, **extra}, timeout=120)


def _video_part(url: str, **options) -> dict:
    return {"type": "video_url", "video_url": {"url": url, **options}}


def _direct_video(data: bytes, **options) -> torch.Tensor:
    prep = PreprocessConfig()
    sampling = sampling_for(prep, options)
    info = probe_video(data)
    frames = decode_frames(data, sample_indices(info.num_frames, info.fps, sampling))
    patches = preprocess_video(frames, prep, sampling, "cpu", channels_last=True)
    model = load_vision("tiny", torch.device("cpu"), torch.float32).model
    with torch.inference_mode():
        return model(patches.pixel_values, [tuple(patches.grid_thw.tolist())])  # [tokens, D]


def _direct_audio(data: bytes) -> torch.Tensor:
    loaded = load_audio("tiny", torch.device("cpu"), torch.float32)
    waveform = decode_audio(data).waveform
    with torch.inference_mode():
        out = loaded.model(log_mel_long(waveform))  # [W, 1500, D]
    keep = audio_window_tokens(waveform.numel(), loaded.cfg.max_source_positions)
    return torch.cat([out[w, :n] for w, n in enumerate(keep)])  # [tokens, D]


def test_video_embedding_equals_direct_encoding(server, media) -> None:
    status, body = _embed(server, [_video_part(media.url("/clip.mp4"))], pooling="none")
    assert status == 200, body
    got = np.array(body["data"][0]["embedding"])
    want = _direct_video(VIDEO).numpy()
    assert got.shape == want.shape and body["data"][0]["num_tokens"] == want.shape[0]
    t, h, w = body["data"][0]["grid_thw"]
    assert t == 2 and t * h * w // 4 == want.shape[0]  # 2 s at 2 fps -> 4 frames -> 2 temporal patches
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert {"fetch", "decode", "queue", "preprocess", "encode"} <= set(body["data"][0]["timings_ms"])


def test_video_options_change_the_sampling_and_the_cache_key(server, media) -> None:
    url = media.url("/clip.mp4")
    status, body = _embed(server, [_video_part(url, nframes=8), _video_part(url, fps=2)], pooling="none")
    assert status == 200, body
    eight, four = body["data"]
    assert eight["grid_thw"][0] == 4 and four["grid_thw"][0] == 2  # different options: two different entries
    np.testing.assert_allclose(eight["embedding"], _direct_video(VIDEO, nframes=8).numpy(), atol=1e-4)
    status, again = _embed(server, [_video_part(url, nframes=8)], pooling="none")
    assert status == 200 and "cache" in again["data"][0]["timings_ms"]
    np.testing.assert_allclose(again["data"][0]["embedding"], eight["embedding"], atol=1e-6)


def test_audio_url_and_input_audio_equal_direct_encoding(server, media) -> None:
    inline = {"type": "input_audio", "input_audio": {"data": base64.b64encode(SHORT_WAV).decode(), "format": "wav"}}
    status, body = _embed(server, [inline, {"type": "audio_url", "audio_url": {"url": media.url("/long.wav")}}],
                          pooling="none")
    assert status == 200, body
    short, long = body["data"]
    np.testing.assert_allclose(short["embedding"], _direct_audio(SHORT_WAV).numpy(), atol=1e-4)
    want_long = _direct_audio(LONG_WAV).numpy()
    assert long["num_tokens"] == want_long.shape[0] == 1500 + 250  # 30 s window + 5 s of the next
    np.testing.assert_allclose(long["embedding"], want_long, atol=1e-4)
    assert short["grid_thw"] == [] and short["num_tokens"] == 150  # 3 s: 300 mel frames -> 150 tokens


def test_one_request_mixes_modalities_in_order(server, media) -> None:
    inputs = [media.url("/img.jpg"), _video_part(media.url("/clip.mp4")),
              {"type": "audio_url", "audio_url": {"url": media.url("/short.wav")}}]
    status, body = _embed(server, inputs)
    assert status == 200, body
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert body["usage"]["prompt_tokens"] == sum(d["num_tokens"] for d in body["data"])
    assert [len(d["embedding"]) for d in body["data"]] == [128, 128, 64]  # tiny ViT out 128, tiny audio d_model 64


@pytest.mark.parametrize(("part", "status", "code"), [
    ({"type": "video_url", "video_url": {"url": "/broken.mp4"}}, 415, None),
    ({"type": "video_url", "video_url": {"url": "/empty.mp4"}}, 415, None),
    ({"type": "video_url", "video_url": {"url": "/noise.mp4"}}, 415, None),
    ({"type": "video_url", "video_url": {"url": "/long.mp4"}}, 413, "media_too_large"),
    ({"type": "video_url", "video_url": {"url": "/clip.mp4", "nframes": 100000}}, 400, "bad_video_options"),
    ({"type": "video_url", "video_url": {"url": "/clip.mp4", "fps": "fast"}}, 400, "bad_video_options"),
    ({"type": "video_url", "video_url": {"url": "/clip.mp4", "video_start": 5, "video_end": 9}}, 400, None),
    ({"type": "audio_url", "audio_url": {"url": "/too-long.wav"}}, 413, "audio_too_long"),
    ({"type": "audio_url", "audio_url": {"url": "/clip.mp4"}}, 415, None),
    ({"type": "input_audio", "input_audio": {"data": "%%%not base64", "format": "wav"}}, 400, None),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "ogg"}}, 400, "unsupported_media_type"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, 415, None),
    ({"type": "input_audio"}, 400, None),
    ({"type": "hologram"}, 400, "unsupported_content"),
])
def test_bad_video_and_audio_fail_with_a_4xx_naming_the_item(server, media, part, status, code) -> None:
    part = {k: ({**v, "url": media.url(v["url"])} if isinstance(v, dict) and "url" in v else v)
            for k, v in part.items()}
    got_status, body = _embed(server, [media.url("/img.jpg"), part])
    assert got_status == status, body
    assert body["error"]["param"] == "input[1]" and "input[1]" in body["error"]["message"]
    if code:
        assert body["error"]["code"] == code


def test_a_bad_video_does_not_harm_concurrent_requests(server, media) -> None:
    results: dict[str, tuple[int, dict]] = {}

    def call(name: str, part: dict) -> None:
        results[name] = _embed(server, [part])

    threads = [threading.Thread(target=call, args=(f"bad{i}", _video_part(media.url("/broken.mp4")))) for i in range(3)]
    threads += [threading.Thread(target=call, args=(f"good{i}", _video_part(media.url("/clip.mp4"), nframes=6)))
                for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(results[f"bad{i}"][0] == 415 for i in range(3))
    assert all(results[f"good{i}"][0] == 200 for i in range(3))
    status, _ = server.get("/health")
    assert status == 200
