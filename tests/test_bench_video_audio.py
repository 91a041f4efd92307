"""`bench.video` and `bench.audio` on tiny media (CPU, seconds), and their building blocks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench import audio as bench_audio
from bench import video as bench_video
from bench.media_make import VideoSpec, make_video
from tests.media_video import make_video as make_test_video

TINY_VIDEO = ["--duration", "4", "--width", "64", "--height", "48", "--fps", "12", "--clip-seconds", "2", "--gop",
              "12", "--frames", "16"]


def test_video_bench_tiny_run(tmp_path, capsys) -> None:
    argv = [*TINY_VIDEO, "--chunks", "2,4", "--naive-chunks", "3", "--queue", "2", "--media-dir",
            str(tmp_path / "media"), "--device", "cpu", "--out-dir", str(tmp_path), "--name", "v"]
    assert bench_video.main(argv) == 0
    payload = json.loads((tmp_path / "v.json").read_text())
    assert {"video", "num_frames", "num_sampled", "decode_work_frames", "cores", "dali", "env", "rows",
            "identical"} <= payload.keys()
    assert payload["identical"] is True
    assert payload["num_frames"] == 48 and payload["num_sampled"] == 16
    assert payload["num_keyframes"] >= 2  # each 2 s clip starts on a keyframe
    assert [r["variant"] for r in payload["rows"]] == ["sequential", "ffmpeg_threads", "naive_3", "ours_2", "ours_4",
                                                       "queue_2"]
    for row in payload["rows"]:
        assert row["identical"] is True and row["seconds"] > 0 and row["speedup"] > 0
        assert 16 <= row["work_frames"] <= 48
    assert payload["dali"]["note"].startswith("skipped")
    out = capsys.readouterr().out
    assert out.count("SUMMARY video decode 16 frames of 4 s 48p: ours") == 1 and "identical: true" in out


def test_video_bench_takes_a_file_and_skips_variants(tmp_path) -> None:
    path = tmp_path / "clip.mp4"
    path.write_bytes(make_test_video(num_frames=60, fps=24, gop=12))
    argv = ["--video", str(path), "--frames", "10", "--chunks", "3", "--skip", "ffmpeg_threads,naive,queue,dali,hybrid",
            "--repeats", "2", "--out-dir", str(tmp_path)]
    assert bench_video.main(argv) == 0
    payload = json.loads((tmp_path / "video.json").read_text())
    assert payload["video"] == str(path) and payload["identical"] is True
    assert [r["variant"] for r in payload["rows"]] == ["sequential", "ours_3"]


def test_decode_work_and_count_parsing() -> None:
    keys = (0, 10, 20)
    assert bench_video.decode_work([2, 5], keys, [[2, 5]]) == 6  # frames 0..5
    assert bench_video.decode_work([2, 15], keys, [[2, 15]]) == 3 + 6  # 0..2, then seek to 10: 10..15
    assert bench_video.decode_work([2, 5], keys, [[2], [5]]) == 3 + 6  # the second run decodes 0..5 again
    assert bench_video.parse_counts("4,cpu,2cpu,4", 16) == [4, 16, 32]
    assert bench_video.parse_hybrid("cpu+4,12+2", 16) == [(16, 4), (12, 2)]


def test_made_video_is_cached_by_its_parameters(tmp_path) -> None:
    import decord

    spec = VideoSpec(duration_s=3, width=32, height=16, fps=10, clip_s=1, gop=5)
    path = make_video(spec, tmp_path)
    made_ns = path.stat().st_mtime_ns
    assert make_video(spec, tmp_path) == path and path.stat().st_mtime_ns == made_ns  # cached, not made again
    reader = decord.VideoReader(str(path), num_threads=1)
    assert len(reader) == 30 and reader.get_avg_fps() == 10
    assert {0, 10, 20} <= set(reader.get_key_indices())  # every repeated clip starts on a keyframe
    frames = reader.get_batch([0, 10, 20]).asnumpy()
    assert np.array_equal(frames[0], frames[1]) and np.array_equal(frames[1], frames[2])  # stream copies
    assert make_video(VideoSpec(duration_s=2, width=32, height=16, fps=10, clip_s=1, gop=5), tmp_path) != path


def test_audio_bench_tiny_run(tmp_path, capsys) -> None:
    argv = ["--batch", "2", "--check-clips", "2", "--repeats", "1", "--audio-seconds", "2", "--device", "cpu",
            "--media-dir", str(tmp_path / "media"), "--out-dir", str(tmp_path), "--name", "a"]
    assert bench_audio.main(argv) == 0
    payload = json.loads((tmp_path / "a.json").read_text())
    assert {"max_abs_diff", "within_tolerance", "speedup", "target_met", "mel_rows", "decode_rows", "env"} <= \
        payload.keys()
    assert payload["within_tolerance"] is True and payload["max_abs_diff"] <= 1e-4
    assert payload["target_met"] is False  # the target is for a GPU
    assert [r["pipeline"] for r in payload["mel_rows"]] == ["transformers WhisperFeatureExtractor cpu",
                                                            "mmenc log_mel cpu, waveforms from host"]
    assert all(r["clips_s"] > 0 and r["x_realtime"] == pytest.approx(r["clips_s"] * 30) for r in payload["mel_rows"])
    assert [r["format"] for r in payload["decode_rows"]] == ["wav", "flac", "mp3"]
    for row in payload["decode_rows"]:
        assert row["note"] == "" and row["ms"] > 0 and row["source_rate"] == 44100 and row["num_channels"] == 2
        assert abs(row["out_seconds"] - 2) < 0.05
    assert capsys.readouterr().out.count("SUMMARY audio log-mel 2 x 30 s on cpu") == 1


def test_speech_batch_is_seeded_and_distinct() -> None:
    clips = bench_audio.speech_batch(2, seed=1, num_distinct=1)
    assert clips.shape == (2, 480000) and clips.dtype == np.float32
    assert np.array_equal(clips, bench_audio.speech_batch(2, seed=1, num_distinct=1))
    assert not np.allclose(clips[0], clips[1])  # same base signal, other rotation, gain and noise
    assert 0.05 < np.abs(clips).max() <= 1.0


def test_video_summary_line_names_the_best_and_the_failures() -> None:
    rows = [{"variant": "sequential", "seconds": 132.7}, {"variant": "ffmpeg_threads", "seconds": 43.6},
            {"variant": "naive_16", "seconds": 15.4}, {"variant": "ours_8", "seconds": 12.0},
            {"variant": "ours_16", "seconds": 8.1}, {"variant": "queue_16", "seconds": 8.4},
            {"variant": "hybrid_16c4g", "seconds": 6.0}, {"variant": "dali_x4", "error": "no NVDEC"}]
    line = bench_video.summary_line("video decode 768 frames of 3600 s 720p", rows, 132.7)
    assert line == ("SUMMARY video decode 768 frames of 3600 s 720p: ours 8.1 s (N=16) vs sequential 132.7 s (16.4x), "
                    "ffmpeg threads 43.6 s, naive 16 chunks 15.4 s, hybrid_16c4g 6.0 s; failed: dali_x4")
