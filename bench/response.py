"""`mmenc bench response`: CPU cost of one embedding's trip through the JSON layer, per image.

The gateway turns each embedding into base64 inside a JSON body, and the load generator reads the body
back. For `pooling: "none"` (every token's embedding) that is megabytes per image: a qwen2.5-vl-7b
448x448 image is 256 tokens x 3584 floats (4.9 MB of base64), a 1080p one ~725 tokens (13.9 MB). This
times, on one core, the way the gateway built that body before (`json.dumps` of a base64 `str`) and now
(`json_splice`: base64 bytes joined into the dumped skeleton), and the load generator's parse with and
without `without_embedding_strings`. Same run, same arrays; best of `--iters`.

`--save-model DIR` instead writes a tiny random ViT with a `--out-dim` output (the 7B's 3584 by default), so
`mmenc bench serve --server-args "--vision-model DIR ..."` can load the gateway with 7B-size embeddings on a CPU.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.common import markdown_table
from bench.loadgen import without_embedding_strings
from encoder_server.json_splice import Base64Bytes, dumps


def _best_ms(fn: Callable[[], Any], iters: int) -> float:
    fn()
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _body(array: np.ndarray, spliced: bool) -> bytes:
    raw = base64.b64encode(np.ascontiguousarray(array, dtype="<f4").data)
    value: Any = Base64Bytes(raw) if spliced else raw.decode()
    response = {"object": "list", "model": "m", "usage": {"prompt_tokens": array.shape[0]},
                "data": [{"object": "embedding", "index": 0, "embedding": value, "num_tokens": array.shape[0],
                          "timings_ms": {"encode": 1.0}}]}
    return dumps(response) if spliced else json.dumps(response).encode()


def row(n: int, dim: int, iters: int) -> dict[str, Any]:
    array = np.random.default_rng(0).standard_normal((n, dim), dtype=np.float32)
    body = _body(array, spliced=True)
    assert json.loads(body) == json.loads(_body(array, spliced=False)), "the two bodies must be the same JSON"
    before, after = _best_ms(lambda: _body(array, False), iters), _best_ms(lambda: _body(array, True), iters)
    parse = _best_ms(lambda: json.loads(body), iters)
    skim = _best_ms(lambda: json.loads(without_embedding_strings(body)), iters)
    return {"tokens": n, "dim": dim, "base64_MB": len(body) / 1e6, "gateway_before_ms": before,
            "gateway_after_ms": after, "gateway_speedup": before / after, "client_before_ms": parse,
            "client_after_ms": skim, "client_speedup": parse / skim}


def save_model(directory: str, out_dim: int) -> None:
    import dataclasses

    import torch
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from encoder_server.config import VisionConfig

    cfg = dataclasses.replace(VisionConfig(), out_hidden_size=out_dim)
    torch.manual_seed(0)
    Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(**cfg.to_hf_dict())).save_pretrained(directory)
    print(f"wrote a tiny ViT with {out_dim}-dim embeddings to {directory}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mmenc bench response", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="256,725", help="tokens per image (448px and 1080p for qwen2.5-vl)")
    p.add_argument("--out-dim", type=int, default=3584)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--save-model", metavar="DIR", help="write the tiny ViT with --out-dim outputs and exit")
    a = p.parse_args(argv)
    if a.save_model:
        save_model(a.save_model, a.out_dim)
        return 0
    table = [row(int(t), a.out_dim, a.iters) for t in a.tokens.split(",") if t]
    print(markdown_table(table, list(table[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
