"""`mmenc bench serve` end to end on the CPU (tiny model, small images), plus its parsing helpers."""

from __future__ import annotations

import io
import itertools
import json
import time

import pytest
from PIL import Image

from bench.media import ImageMix, RequestFactory, with_nonce
from bench.serve import main
from bench.serve_report import (
    parse_metrics,
    per_worker_stats,
    server_stats,
    starved_fraction,
    summarize,
    worker_samples,
)
from tests.server_process import free_port

FAST = ["--mix", "224", "--distinct", "4", "--warmup-requests", "4", "--no-progress"]


def _run(tmp_path, *flags: str) -> dict:
    assert main([*FAST, *flags, "--out-dir", str(tmp_path), "--name", "run"]) == 0
    return json.loads((tmp_path / "run.json").read_text())


def _check_row(row: dict) -> None:
    assert row["ok"] > 0 and row["errors"] == 0 and row["error_classes"] == {}
    assert row["rps"] > 0 and row["img_s"] > 0 and row["tokens_s"] > 0
    assert 0 < row["p50_ms"] <= row["p90_ms"] <= row["p99_ms"] <= row["max_ms"]
    assert row["encode_ms"] > 0 and row["total_ms"] > 0


def test_closed_loop_with_naive_baseline(tmp_path):
    server_args = "--vision-model tiny --device cpu --cache-bytes 0"
    result = _run(tmp_path, "--start", "--server-args", server_args, "--concurrency", "4", "--duration", "2",
                  "--baseline", "naive", "--naive-device", "cpu")
    ours, naive = ([r for r in result["rows"] if r["server"] == name] for name in ("mmenc", "naive"))
    assert len(ours) == 1 and len(naive) == 1
    for row in ours + naive:
        _check_row(row)
        assert row["mode"] == "closed" and row["concurrency"] == 4
        assert row["tokens_per_img"] == 64  # 224x224 -> 16x16 patches -> 64 merged tokens
    assert result["ratio"]["peak_img_s"] > 0 and result["ratio"]["per_step"][0]["step"] == 4
    assert result["baseline"]["preset"] == "tiny" and result["startup_s"]["naive"] > 0
    agreement = result["baseline"]["agreement"]  # same weights, same image: the same function
    assert agreement["num_tokens"] == agreement["naive_num_tokens"] and agreement["cosine"] > 0.99
    assert (tmp_path / "run.mmenc.log").exists() and (tmp_path / "run.naive.log").exists()


def test_unreachable_server_is_a_clear_error(tmp_path, capsys):
    start = time.monotonic()
    assert main(["--url", f"http://127.0.0.1:{free_port()}", "--out-dir", str(tmp_path)]) == 2
    assert time.monotonic() - start < 15
    assert "cannot reach" in capsys.readouterr().err


def test_mix_parsing():
    mixed = ImageMix.parse("mixed")
    assert mixed.sizes == ((448, 448), (1920, 1080), (3840, 2160))
    assert mixed.weights == pytest.approx((0.5, 0.4, 0.1))
    assert ImageMix.parse("640x480=3,224").weights == pytest.approx((0.75, 0.25))
    for bad in ("100", "224=0", "huge"):
        with pytest.raises(ValueError):
            ImageMix.parse(bad)


def test_unique_bytes_decode_to_the_same_pixels():
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (10, 200, 30)).save(buf, "JPEG")
    blob = buf.getvalue()
    a, b = with_nonce(blob, 1), with_nonce(blob, 2)
    assert len({blob, a, b}) == 3
    assert Image.open(io.BytesIO(a)).tobytes() == Image.open(io.BytesIO(blob)).tobytes()


def test_request_factory_is_seeded():
    mix = ImageMix.parse("224=0.5,448=0.5")
    images = {"224": [b"\xff\xd8a", b"\xff\xd8b"], "448": [b"\xff\xd8c"]}

    def bodies() -> list[bytes]:
        make = RequestFactory(mix, images, None, 3, is_data_uri=True, is_unique=False, encoding_format="base64",
                              nonces=itertools.count(), seed=7)
        return [make()[0] for _ in range(5)]

    assert bodies() == bodies()
    assert len(json.loads(bodies()[0])["input"]) == 3


METRICS_BEFORE = """\
# TYPE mmenc_forwards_total counter
mmenc_forwards_total{worker="0",modality="image"} 10
mmenc_forwards_total{worker="1",modality="image"} 10
# TYPE mmenc_forward_items histogram
mmenc_forward_items_bucket{le="+Inf"} 20
mmenc_forward_items_count 20
mmenc_forward_items_sum 40
# TYPE mmenc_encode_busy_seconds_total counter
mmenc_encode_busy_seconds_total{worker="0"} 1
mmenc_encode_busy_seconds_total{worker="1"} 1
"""
METRICS_AFTER = METRICS_BEFORE.replace(" 10\n", " 20\n").replace("count 20", "count 40").replace(
    "sum 40", "sum 200").replace("} 1\n", "} 3\n")


def test_server_stats_from_metric_deltas():
    stats = server_stats(parse_metrics(METRICS_BEFORE), parse_metrics(METRICS_AFTER), wall_s=4.0, num_workers=2,
                         queue_depths=[1.0, 3.0])
    assert stats["forwards"] == 20 and stats["items_per_forward"] == 8.0
    assert stats["busy_fraction"] == pytest.approx(0.5)  # 4 busy seconds / (4 s x 2 workers)
    assert stats["tokens_per_forward"] is None  # not exported: null, not an error
    assert stats["queue_depth_mean"] == 2.0 and stats["queue_depth_max"] == 3.0
    none = server_stats(None, None, 1.0, 1, [])
    assert set(none.values()) == {None}


def test_summary_of_no_successes_has_null_latencies():
    from bench.loadgen import RequestRecord

    row = summarize([RequestRecord(0.0, 0.1, 503, "unavailable", 1)], wall_s=1.0)
    assert row["ok"] == 0 and row["p50_ms"] is None and row["error_classes"] == {"503 unavailable": 1}


def test_per_worker_stats_and_starvation():
    before, after = worker_samples(METRICS_BEFORE), worker_samples(METRICS_AFTER)
    assert set(before) == {"0", "1"}  # the unlabeled histogram samples belong to no worker
    rows = per_worker_stats(before, after, wall_s=4.0, timeline=[])
    assert [(r["worker"], r["forwards"], r["busy_fraction"]) for r in rows] == [("0", 10, 0.5), ("1", 10, 0.5)]

    def snap(busy0: float, depth0: float, busy1: float, depth1: float) -> dict:
        return {"0": {"mmenc_encode_busy_seconds_total": busy0, "mmenc_queue_depth": depth0},
                "1": {"mmenc_encode_busy_seconds_total": busy1, "mmenc_queue_depth": depth1}}

    # 3 intervals of 1 s: both busy; worker 1 idle while worker 0 keeps a queue (starved); worker 1 idle with
    # nothing queued anywhere (fine).
    timeline = [(0.0, snap(0, 2, 0, 1)), (1.0, snap(1, 3, 1, 0)), (2.0, snap(2, 4, 1.1, 0)),
                (3.0, snap(2.1, 0, 1.2, 0))]
    assert starved_fraction(timeline) == pytest.approx(1 / 3)
    rows = per_worker_stats(timeline[0][1], timeline[-1][1], 3.0, timeline)
    assert rows[0]["queue_depth_max"] == 4 and rows[1]["queue_depth_mean"] == 0.25
    assert starved_fraction([(0.0, {"0": {}}), (1.0, {"0": {}})]) is None  # one worker: no balance to judge


def test_load_generator_skips_embedding_strings_only():
    from bench.loadgen import without_embedding_strings

    body = {"data": [{"embedding": "QUJD" * 100, "num_tokens": 3, "timings_ms": {"encode": 1.0}},
                     {"embedding": [0.5, 1.5], "num_tokens": 4}], "timings_ms": {"total": 2.0}}
    for text in (json.dumps(body), json.dumps(body, separators=(",", ":"))):
        parsed = json.loads(without_embedding_strings(text.encode()))
        assert parsed["data"][0] == {"embedding": "", "num_tokens": 3, "timings_ms": {"encode": 1.0}}
        assert parsed["data"][1] == body["data"][1] and parsed["timings_ms"] == {"total": 2.0}
    assert without_embedding_strings(b'{"embedding":"QUJD') == b'{"embedding":"QUJD'  # truncated: left as is


def test_bench_response_and_its_wide_model(tmp_path, capsys):
    from bench.response import main as response_main

    assert response_main(["--tokens", "4,16", "--out-dim", "64", "--iters", "1"]) == 0
    table = capsys.readouterr().out
    assert "gateway_before_ms" in table and table.count("\n") >= 4
    assert response_main(["--save-model", str(tmp_path / "vit"), "--out-dim", "96"]) == 0
    import torch

    from encoder_server.models.loader import load_vision

    loaded = load_vision(str(tmp_path / "vit"), torch.device("cpu"), torch.float32)
    assert loaded.cfg.out_hidden_size == 96
