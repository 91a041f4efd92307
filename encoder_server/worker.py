"""One encoder worker: fetch -> preprocess -> encode -> publish, batching items across requests.

Requests arrive on the socket thread (`WorkerIO`), which starts each item's fetch (and CPU decode) on a
thread pool at once. Fetched items land on a queue; the encode loop takes everything that is ready,
decodes on the device where the backend does that, packs items under the token budget into forwards,
and publishes each item's embedding the moment its forward is done.
"""

from __future__ import annotations

import logging
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import zmq

from encoder_server import messages as m
from encoder_server.config import FetchConfig, PreprocessConfig, WorkerConfig
from encoder_server.models.loader import load_vision, resolve_device, resolve_dtype
from encoder_server.worker_io import WorkerIO
from preprocess.decode import decode_images, resolve_backend
from preprocess.errors import DecodeError, MediaError
from preprocess.fetch import FetchPolicy, fetch_media
from preprocess.image import preprocess_images, smart_resize

log = logging.getLogger(__name__)


@dataclass
class Item:
    """One media item between its arrival and its result."""

    identity: bytes
    request_id: str
    index: int
    pooling: str
    arrived: float
    ready_at: float = 0.0
    blob: bytes | None = None
    image: torch.Tensor | None = None  # uint8 [3, H, W] once decoded
    error: MediaError | None = None
    grid: tuple[int, int, int] | None = None
    timings_ms: dict[str, float] = field(default_factory=dict)

    @property
    def num_patches(self) -> int:
        assert self.grid is not None
        return self.grid[0] * self.grid[1] * self.grid[2]


def fetch_policy(cfg: FetchConfig) -> FetchPolicy:
    return FetchPolicy(max_bytes=cfg.max_download_bytes, timeout_s=cfg.fetch_timeout_s,
                       max_redirects=cfg.max_redirects, allow_private=cfg.allow_private_urls,
                       allowed_local_dir=cfg.allowed_local_media_dir)


def pack_by_budget(items: list[Item], max_tokens: int, max_items: int) -> list[list[Item]]:
    """Split items (arrival order kept) into forwards of at most `max_tokens` patches and `max_items` items.

    An item larger than the budget alone still runs, alone.
    """
    batches: list[list[Item]] = []
    current: list[Item] = []
    tokens = 0
    for item in items:
        if current and (tokens + item.num_patches > max_tokens or len(current) >= max_items):
            batches.append(current)
            current, tokens = [], 0
        current.append(item)
        tokens += item.num_patches
    if current:
        batches.append(current)
    return batches


class EncoderWorker:
    def __init__(self, address: str, worker: WorkerConfig, prep: PreprocessConfig, fetch: FetchConfig) -> None:
        self.cfg = worker
        self.prep = prep
        self.policy = fetch_policy(fetch)
        self.device = resolve_device(worker.device)
        self.dtype = resolve_dtype(worker.dtype, self.device)
        loaded = load_vision(worker.vision_model, self.device, self.dtype)
        self.model, self.fingerprint = loaded.model, loaded.fingerprint
        if worker.compile and self.device.type == "cuda":
            self.model.compile_blocks()
            self.warm_up()
        vc = loaded.cfg
        if (vc.patch_size, vc.spatial_merge_size, vc.temporal_patch_size) != (
                prep.patch_size, prep.merge_size, prep.temporal_patch_size):
            raise ValueError(f"preprocessing patch/merge/temporal sizes {prep.patch_size}/{prep.merge_size}/"
                             f"{prep.temporal_patch_size} do not match the model's {vc.patch_size}/"
                             f"{vc.spatial_merge_size}/{vc.temporal_patch_size}")
        self.backend = resolve_backend(prep.decode_backend, self.device)
        self.ready_items: queue.Queue[Item | None] = queue.Queue()
        self.pool = ThreadPoolExecutor(fetch.num_fetch_threads, thread_name_prefix="fetch")
        ready = m.WorkerReady(self.fingerprint, str(self.device), vc.out_hidden_size)
        self.io = WorkerIO(address, self.on_request, ready)
        self.num_forwards = 0

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run two packed forwards of different sizes so compilation happens before the first request."""
        start = time.perf_counter()
        unit = self.model.cfg.spatial_merge_size
        for grids in ([(1, 4 * unit, 6 * unit)], [(1, 8 * unit, 4 * unit), (1, 2 * unit, 2 * unit)]):
            num_patches = sum(t * h * w for t, h, w in grids)
            self.model(torch.zeros(num_patches, self.model.cfg.patch_dim, device=self.device, dtype=self.dtype), grids)
        log.info("warm-up (compile) took %.1f s", time.perf_counter() - start)

    # ------------------------------------------------------------------ socket thread side

    def on_request(self, identity: bytes, req: m.EncodeRequest, payload: list[zmq.Frame]) -> None:
        inline = iter(payload)
        now = time.perf_counter()
        for spec in req.items:
            item = Item(identity, req.request_id, spec.index, req.pooling, now)
            blob = next(inline).bytes if spec.inline else None
            self.pool.submit(self._fetch, item, spec.source, blob)

    def _fetch(self, item: Item, source: str, blob: bytes | None) -> None:
        """Runs on the fetch pool: download (unless inline), and decode here when decoding is on the CPU."""
        start = time.perf_counter()
        try:
            item.blob = blob if blob is not None else fetch_media(source, self.policy)
            item.timings_ms["fetch"] = _ms_since(start)
            if self.backend == "pil":
                start = time.perf_counter()
                item.image = _one(decode_images([item.blob], "pil", "cpu", self.prep.max_source_pixels))
                item.blob = None
                item.timings_ms["decode"] = _ms_since(start)
        except MediaError as e:
            item.error = e
        except Exception as e:  # a decoder bug must fail its item, not the worker
            log.exception("item %s/%d: unexpected fetch/decode failure", item.request_id, item.index)
            item.error = MediaError(f"internal error while reading media: {type(e).__name__}", code="internal",
                                    status=500)
        item.ready_at = time.perf_counter()
        self.ready_items.put(item)

    # ------------------------------------------------------------------ encode loop

    def run(self) -> None:
        self.sender = self.io.sender()
        self.io.start()
        log.info("worker ready on %s (device %s, %s, decode %s)", self.io.address, self.device, self.dtype,
                 self.backend)
        while (items := self.take_ready()) is not None:
            items = self.decode(items)
            for batch in pack_by_budget(items, self.cfg.max_batch_tokens, self.cfg.max_batch_items):
                try:
                    self.encode_and_publish(batch)
                except Exception as e:  # e.g. CUDA OOM: fail this forward's items, keep serving
                    log.exception("forward of %d items failed", len(batch))
                    for it in batch:
                        it.error = MediaError(f"encoder failed: {type(e).__name__}", code="internal", status=500)
                        self.publish_error(it)

    def take_ready(self) -> list[Item] | None:
        """Block for one ready item, then take every other one already waiting. None means shut down."""
        first = self.ready_items.get()
        if first is None:
            return None
        items = [first]
        while True:
            try:
                nxt = self.ready_items.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                self.ready_items.put(None)
                break
            items.append(nxt)
        return items

    def decode(self, items: list[Item]) -> list[Item]:
        """Decode what is still compressed (batched, on the device), compute grids; publish failures."""
        start = time.perf_counter()
        pending = [it for it in items if it.error is None and it.image is None]
        if pending:
            decoded = decode_images([it.blob for it in pending], self.backend, self.device,
                                    self.prep.max_source_pixels)
            for it, out in zip(pending, decoded, strict=True):
                it.blob = None
                if isinstance(out, MediaError):
                    it.error = out
                else:
                    it.image = out
                    it.timings_ms["decode"] = _ms_since(start)
        good = []
        for it in items:
            if it.error is None:
                try:
                    height, width = it.image.shape[-2:]
                    h, w = smart_resize(height, width, self.prep.resize_factor, self.prep.min_pixels,
                                        self.prep.max_pixels, self.prep.max_aspect_ratio)
                    it.grid = (1, h // self.prep.patch_size, w // self.prep.patch_size)
                except MediaError as e:
                    it.error = e
            if it.error is not None:
                self.publish_error(it)
            else:
                good.append(it)
        return good

    @torch.inference_mode()
    def encode_and_publish(self, batch: list[Item]) -> None:
        batch_start = start = time.perf_counter()
        try:
            inputs = preprocess_images([it.image for it in batch], self.prep, self.device, out_dtype=self.dtype)
        except MediaError as e:  # unexpected: sizes were checked; fail the batch's items clearly
            for it in batch:
                it.error = e
                self.publish_error(it)
            return
        prep_ms = _ms_since(start)
        start = time.perf_counter()
        grids = [it.grid for it in batch]
        out = self.model(inputs.pixel_values, grids)  # [sum(tokens), D]
        self.num_forwards += 1
        lengths = [it.num_patches // self.model.cfg.merge_unit for it in batch]
        pooled, full = self.pool_outputs(out, lengths, [it.pooling for it in batch])
        encode_ms = _ms_since(start)
        for i, it in enumerate(batch):
            it.image = None
            it.timings_ms.update(queue=(batch_start - it.ready_at) * 1e3, preprocess=prep_ms, encode=encode_ms)
            tensor = pooled[i] if it.pooling == "mean" else full[i]
            self.publish(it, tensor, lengths[i])
        log.debug("forward: %d items, %d patches, preprocess %.1f ms, encode %.1f ms",
                  len(batch), sum(it.num_patches for it in batch), prep_ms, encode_ms)

    @staticmethod
    def pool_outputs(out: torch.Tensor, lengths: list[int], poolings: list[str]
                     ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Mean per item on the device, then one device->host copy for the means and one for the rest."""
        out32 = out.float()  # [T, D]
        item_ids = torch.repeat_interleave(torch.arange(len(lengths), device=out.device),
                                           torch.tensor(lengths, device=out.device))  # [T]
        sums = torch.zeros(len(lengths), out.shape[1], device=out.device).index_add_(0, item_ids, out32)
        pooled = (sums / torch.tensor(lengths, device=out.device)[:, None]).cpu()  # [N, D]
        full = list(out32.cpu().split(lengths)) if "none" in poolings else []
        return pooled, full

    def publish(self, it: Item, tensor: torch.Tensor, num_tokens: int) -> None:
        header = m.ItemResult(it.request_id, it.index, dtype="float32", shape=tuple(tensor.shape),
                              grid_thw=it.grid, num_tokens=num_tokens,
                              timings_ms={k: round(v, 3) for k, v in it.timings_ms.items()})
        self.sender.send_multipart([it.identity, m.pack(header), m.tensor_frame(tensor)], copy=False)

    def publish_error(self, it: Item) -> None:
        err = it.error or DecodeError("unknown error")
        header = m.ItemResult(it.request_id, it.index, error_code=err.code, error_message=err.message,
                              error_status=err.status)
        self.sender.send_multipart([it.identity, m.pack(header)])

    def stop(self) -> None:
        self.ready_items.put(None)


def _one(results: list[torch.Tensor | MediaError]) -> torch.Tensor:
    if isinstance(results[0], MediaError):
        raise results[0]
    return results[0]


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


def worker_main(address: str, worker: WorkerConfig, prep: PreprocessConfig, fetch: FetchConfig,
                log_level: str = "info") -> None:
    """Process entry point (spawned by the supervisor)."""
    from encoder_server.logs import set_process_name, setup_logging

    setup_logging(log_level)
    set_process_name("mmenc-worker-0")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    EncoderWorker(address, worker, prep, fetch).run()
