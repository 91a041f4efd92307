"""`mmenc bench video-serve` on the CPU with the tiny model: a smoke run that must produce every figure."""

from __future__ import annotations

import json

from bench.video_serve import main


def test_video_serve_bench_smoke(tmp_path) -> None:
    code = main(["--server-args", "--llm none --num-fetch-procs 1", "--long-duration", "6", "--long-width", "160",
                 "--long-height", "120", "--long-nframes", "8", "--long-repeats", "1", "--clips", "2",
                 "--clip-seconds", "1", "--clip-size", "160x120", "--concurrency", "1", "--duration", "1.5",
                 "--media-dir", str(tmp_path / "media"), "--out-dir", str(tmp_path), "--name", "vs"])
    assert code == 0
    result = json.loads((tmp_path / "vs.json").read_text())
    (long,) = result["long"]
    assert long["grid_thw"][0] == 4 and {"decode", "encode"} <= set(long["timings_ms"])  # 8 frames -> t = 4
    (clips,) = result["clips"]
    assert clips["videos"] > 0 and clips["videos_s"] > 0 and clips["p50_ms"] > 0
