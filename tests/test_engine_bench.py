"""`bench/engine.py` runs end to end on CPU with the tiny model and writes its JSON."""

from __future__ import annotations

import json

import pytest
import torch

from bench.engine import main
from engine_link.engine import MODEL_PRESETS

pytestmark = pytest.mark.timeout(120)


def test_bench_engine_tiny(tmp_path, capsys) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rc = main(["--model", "tiny", "--device", "cpu", "--batches", "1,3", "--prompt-len", "12", "--decode-len", "4",
                   "--iters", "1", "--policy-requests", "4,2", "--policy-lens", "8,40", "--policy-max-seqs", "2",
                   "--out-dir", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    payload = json.loads((tmp_path / "engine.json").read_text())
    cfg = MODEL_PRESETS["tiny"]
    full_fraction = len(cfg.full_layers) / cfg.num_hidden_layers
    long = payload["kv"][-1]
    assert long["context"] == 131072 and long["ratio"] < 1.5 * full_fraction
    assert [r["batch"] for r in payload["rows"]] == [1, 3]
    for row in payload["rows"]:
        assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0
        assert row["same_tokens"] == 1.0  # greedy outputs equal transformers generate on the same weights
    assert [r["policy"] for r in payload["policy"]] == ["fewest-uncached", "fcfs"]
    assert all(r["short_ttft_p90_s"] > 0 and r["long_ttft_p90_s"] > 0 for r in payload["policy"])
    assert "SUMMARY engine tiny" in capsys.readouterr().out


def test_bench_engine_ops_counts_and_saves(tmp_path, capsys) -> None:
    from bench.engine_ops import main as ops_main
    from engine_link.engine.loader import load_model

    assert ops_main(["--batches", "1,2", "--prompt-len", "16", "--steps", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("mid-narrow")]
    counts = [int(line.split(": ")[1].split()[0]) for line in lines]
    assert len(counts) == 2 and all(c > 100 for c in counts)
    assert ops_main(["--save", str(tmp_path / "m")]) == 0
    model = load_model(str(tmp_path / "m"), torch.device("cpu"), torch.float32)
    assert model.cfg.num_hidden_layers == 24 and model.cfg.n_routed_experts == 32
