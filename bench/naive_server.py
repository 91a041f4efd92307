"""The naive baseline for `mmenc bench serve`: how one would serve the encoder with stock parts.

Deliberately simple: aiohttp, ONE request at a time (a single worker thread), sequential `urllib`
downloads, PIL decode, transformers' `Qwen2VLImageProcessor` on the CPU, and transformers'
`Qwen2_5_VisionTransformerPretrainedModel` (sdpa; bf16 on a GPU, fp32 on the CPU), one forward per
request, mean-pooled. The weights are ours for the same preset (`init_random` with the preset's seed),
so both servers compute the same function. API subset: `POST /v1/embeddings` (same request and
response shape, with `num_tokens` and `timings_ms`), `GET /health`; no `/metrics`.

    python -m bench.naive_server --port 8001 --preset qwen2.5-vl-7b --device cuda
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from aiohttp import web

from encoder_server.config import PreprocessConfig, VisionConfig
from encoder_server.models.loader import init_random
from encoder_server.models.vision import VisionTransformer


class BadItem(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1e3, 3)


class NaiveEncoder:
    """transformers' processor + vision tower with our preset's random weights."""

    def __init__(self, preset: str, device: torch.device, dtype: torch.dtype) -> None:
        from transformers import Qwen2VLImageProcessor
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        cfg = VisionConfig.preset(preset)
        ours = VisionTransformer(cfg)
        init_random(ours, cfg.seed)  # the same weights as `mmenc serve --vision-model <preset>`
        hf_cfg = Qwen2_5_VLVisionConfig(**cfg.to_hf_dict())
        hf_cfg._attn_implementation = "sdpa"
        model = Qwen2_5_VisionTransformerPretrainedModel(hf_cfg)
        model.load_state_dict(ours.state_dict())
        del ours
        self.model = model.to(device, dtype).eval()
        self.device, self.dtype = device, dtype
        self.merge_unit = cfg.merge_unit
        prep = PreprocessConfig()
        self.processor = Qwen2VLImageProcessor(size={"shortest_edge": prep.min_pixels,
                                                     "longest_edge": prep.max_pixels})

    @staticmethod
    def fetch(source: str) -> bytes:
        if source.startswith("data:"):
            try:
                return base64.b64decode(source.partition(",")[2], validate=True)
            except ValueError as e:
                raise BadItem(400, "fetch_failed", f"invalid base64 in data: URI: {e}") from None
        try:
            with urllib.request.urlopen(source, timeout=30) as resp:
                return resp.read()
        except (OSError, ValueError) as e:
            raise BadItem(400, "fetch_failed", f"cannot fetch {source[:100]}: {e}") from None

    def encode(self, sources: list[str], queue_ms: float) -> list[dict[str, Any]]:
        """Embed each source; returns one `{embedding, num_tokens, grid_thw, timings_ms}` per source."""
        from PIL import Image

        timings: list[dict[str, float]] = []
        images = []
        for i, source in enumerate(sources):
            start = time.perf_counter()
            try:
                blob = self.fetch(source)
                fetch_ms = _ms(start)
                start = time.perf_counter()
                images.append(Image.open(io.BytesIO(blob)).convert("RGB"))
            except BadItem as e:
                raise BadItem(e.status, e.code, f"input[{i}]: {e.message}") from None
            except OSError as e:
                raise BadItem(415, "undecodable_media", f"input[{i}]: not a decodable image: {e}") from None
            timings.append({"fetch": fetch_ms, "decode": _ms(start), "queue": queue_ms})
        start = time.perf_counter()
        inputs = self.processor(images=images, return_tensors="pt")
        pixel_values = inputs["pixel_values"].to(self.device, self.dtype)  # [patches, C*tp*p*p]
        grid_thw = inputs["image_grid_thw"]  # [N, 3]
        preprocess_ms = _ms(start)
        start = time.perf_counter()
        with torch.inference_mode():
            merged = self.model(pixel_values, grid_thw.to(self.device)).pooler_output  # [tokens, D]
            counts = (grid_thw.prod(-1) // self.merge_unit).tolist()
            pooled = torch.stack([part.float().mean(0) for part in merged.split(counts)]).cpu().numpy()  # [N, D]
        encode_ms = _ms(start)
        return [{"embedding": pooled[i], "num_tokens": int(counts[i]), "grid_thw": grid_thw[i].tolist(),
                 "timings_ms": {**timings[i], "preprocess": preprocess_ms, "encode": encode_ms}}
                for i in range(len(sources))]


def _sources(body: Any) -> list[str]:
    if not isinstance(body, dict) or "input" not in body:
        raise BadItem(400, "invalid_request", "request body must be a JSON object with 'input'")
    entries = body["input"] if isinstance(body["input"], list) else [body["input"]]
    sources = []
    for i, entry in enumerate(entries):
        url = entry.get("image_url") if isinstance(entry, dict) else entry
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise BadItem(400, "invalid_request", f"input[{i}]: expected a URL string or an image_url part")
        sources.append(url)
    if not sources:
        raise BadItem(400, "invalid_request", "'input' is empty")
    return sources


def _error(e: BadItem) -> web.Response:
    return web.json_response({"error": {"message": e.message, "type": "invalid_request_error", "param": None,
                                        "code": e.code}}, status=e.status)


def build_app(encoder: NaiveEncoder) -> web.Application:
    """The aiohttp app; every request runs on one worker thread, so requests are served one at a time."""
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="naive-encoder")

    async def embeddings(request: web.Request) -> web.Response:
        arrived = time.perf_counter()
        try:
            body = json.loads(await request.read())
        except ValueError as e:
            return _error(BadItem(400, "invalid_request", f"request body is not valid JSON: {e}"))
        try:
            sources = _sources(body)

            def run() -> list[dict[str, Any]]:
                return encoder.encode(sources, queue_ms=_ms(arrived))

            items = await asyncio.get_running_loop().run_in_executor(worker, run)
        except BadItem as e:
            return _error(e)
        fmt = body.get("encoding_format") or "float"
        data = []
        for i, item in enumerate(items):
            emb: np.ndarray = item.pop("embedding")
            encoded = base64.b64encode(emb.astype("<f4").tobytes()).decode() if fmt == "base64" else emb.tolist()
            data.append({"object": "embedding", "index": i, "embedding": encoded, **item})
        total = sum(d["num_tokens"] for d in data)
        return web.json_response({"object": "list", "data": data, "model": "naive-transformers",
                                  "usage": {"prompt_tokens": total, "total_tokens": total},
                                  "timings_ms": {"total": _ms(arrived)}})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "workers": [{"ready": True, "device": str(encoder.device)}]})

    async def close_worker(app: web.Application) -> None:
        worker.shutdown(wait=False, cancel_futures=True)

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/health", health)
    app.on_cleanup.append(close_worker)
    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.naive_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--preset", default="tiny", help="vision preset of encoder_server.config (random weights)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    a = p.parse_args(argv)
    device = torch.device(a.device if a.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    encoder = NaiveEncoder(a.preset, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    print(f"naive server: {a.preset} on {device}, http://{a.host}:{a.port}", flush=True)
    web.run_app(build_app(encoder), host=a.host, port=a.port, print=None)


if __name__ == "__main__":
    main()
