"""One encoder worker: fetch -> preprocess -> encode -> publish, batching items across requests.

Requests arrive on the socket thread (`WorkerIO`), which hands each item to the fetch pool (processes
that download and decode images, sample and decode videos, decode audio) at once. Fetched items go to
the `BatchScheduler`, one modality per forward: images and videos through the ViT, audio windows through
the Whisper-style encoder. The encode loop overlaps its stages: while forward k runs on the GPU, batch
k+1 is taken from the scheduler, decoded and preprocessed on a separate CUDA stream; then forward k's
results are published, item by item.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from typing import TypeVar

import torch
import zmq

from encoder_server import messages as m
from encoder_server import metrics
from encoder_server.config import FetchConfig, PreprocessConfig, WorkerConfig
from encoder_server.encode_inputs import EncodeInputs, audio_forward, audio_inputs, audio_window_tokens
from encoder_server.models.audio import load_audio
from encoder_server.models.loader import load_vision, resolve_device, resolve_dtype
from encoder_server.scheduler import BatchScheduler
from encoder_server.video_options import sampling_for
from encoder_server.worker_cache import WorkerCache
from encoder_server.worker_io import WorkerIO, destination
from encoder_server.worker_items import InFlight, Item, Prepared, to_host
from preprocess.decode import decode_images, displayed_size, resolve_backend
from preprocess.errors import MediaError
from preprocess.fetch_pool import FetchPool, FetchResult, FetchTask
from preprocess.image import preprocess_images, smart_resize, to_device
from preprocess.media_read import AudioRead, VideoRead
from preprocess.video import preprocess_video
from preprocess.video_sampling import frame_size

log = logging.getLogger(__name__)
R = TypeVar("R")
FETCH_START_TIMEOUT_S = 120.0


class EncoderWorker:
    def __init__(self, index: int, address: str, worker: WorkerConfig, prep: PreprocessConfig,
                 fetch: FetchConfig) -> None:
        self.name = f"worker-{index}"
        self.cfg, self.prep = worker, prep
        self.device = resolve_device(worker.device)
        self.dtype = resolve_dtype(worker.dtype, self.device)
        loaded = load_vision(worker.vision_model, self.device, self.dtype)
        self.model, self.fingerprint = loaded.model, loaded.fingerprint
        vc = loaded.cfg
        if (vc.patch_size, vc.spatial_merge_size, vc.temporal_patch_size) != (
                prep.patch_size, prep.merge_size, prep.temporal_patch_size):
            raise ValueError(f"preprocessing patch/merge/temporal sizes {prep.patch_size}/{prep.merge_size}/"
                             f"{prep.temporal_patch_size} do not match the model's {vc.patch_size}/"
                             f"{vc.spatial_merge_size}/{vc.temporal_patch_size}")
        self.backend = resolve_backend(prep.decode_backend, self.device)
        self.audio = None if worker.audio_model == "none" else load_audio(worker.audio_model, self.device, self.dtype)
        if worker.compile and self.device.type == "cuda":
            self.model.compile_blocks()
            self.warm_up()
        self.is_cuda = self.device.type == "cuda"
        self.dali_device = (self.device.index or 0) if self.is_cuda else None  # None: DALI's CPU video decoder
        if prep.video_decode_backend != "decord":
            from preprocess.video_dali import check_dali

            check_dali(self.dali_device)  # fail at start, not on the first video
        self.upload_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self.scheduler: BatchScheduler[Item] = BatchScheduler(worker.max_batch_tokens, worker.max_batch_items,
                                                              worker.max_wait_ms / 1e3)
        self.cache = self._open_cache(worker, prep) if worker.cache_bytes else None
        max_result_bytes = max(prep.max_video_decoded_bytes, int(prep.max_audio_duration_s * 16000 * 4))
        self.fetch_pool = FetchPool(fetch.num_fetch_procs, fetch.policy(), prep.max_source_pixels,
                                    item_timeout_s=fetch.fetch_timeout_s + 5.0, name=f"mmenc-fetch-{index}",
                                    max_result_bytes=max_result_bytes)
        self.video_timeout_s = fetch.fetch_timeout_s + prep.video_decode_timeout_s + 5.0
        if not self.fetch_pool.wait_ready(FETCH_START_TIMEOUT_S):  # ready means ready: no first-request stall
            log.warning("%s: fetch processes not all started after %.0f s; serving anyway", self.name,
                        FETCH_START_TIMEOUT_S)
        ready = m.WorkerReady(self.fingerprint, str(self.device), vc.out_hidden_size, os.getpid())
        self.io = WorkerIO(address, self.on_request, ready)
        self._local = threading.local()  # one PUSH socket per publishing thread (sockets are not thread-safe)
        self.queue_depth = metrics.QUEUE_DEPTH.labels(self.name)

    def _open_cache(self, worker: WorkerConfig, prep: PreprocessConfig) -> WorkerCache | None:
        try:
            return WorkerCache(self.fingerprint, prep, worker.cache_bytes, worker.cache_by_url, worker.cache_name)
        except OSError as e:  # e.g. /dev/shm too small: serve without a cache rather than not at all
            log.warning("%s: embedding cache unavailable (%s); running without it", self.name, e)
            return None

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run two packed forwards of different sizes so compilation happens before the first request."""
        start = time.perf_counter()
        unit = self.model.cfg.spatial_merge_size
        for grids in ([(1, 4 * unit, 6 * unit)], [(1, 8 * unit, 4 * unit), (1, 2 * unit, 2 * unit)]):
            num_patches = sum(t * h * w for t, h, w in grids)
            self.model(torch.zeros(num_patches, self.model.cfg.patch_dim, device=self.device, dtype=self.dtype), grids)
        log.info("warm-up (compile) took %.1f s", time.perf_counter() - start)

    # ------------------------------------------------------------------ socket thread and fetch pool side

    def on_request(self, identity: bytes, req: m.EncodeRequest, payload: list[zmq.Frame]) -> None:
        inline = iter(payload)
        now = time.perf_counter()
        for spec in req.items:
            metrics.ITEMS.labels(spec.modality).inc()
            item = Item(destination(identity, req.reply_to), req.request_id, spec.index, req.pooling,
                        spec.modality, now, wants_size=bool(req.reply_to))
            blob = next(inline).bytes if spec.inline else None
            item.has_uuid = spec.uuid is not None
            try:
                task = self.fetch_task(item, spec, blob)
            except (MediaError, ValueError) as e:
                item.error = e if isinstance(e, MediaError) else MediaError(str(e), code="bad_video_options")
                self.publish_error(item)
                continue
            if self.cache is not None:
                item.route_key = self.cache.route_key(spec.route_key, item.has_uuid, item.key_variant)
                if self.publish_cached(item, self.cache.get_by_route(item.route_key)):
                    continue
            if not spec.source and not spec.inline:
                item.error = MediaError(f"uuid {spec.uuid!r} is not in the cache; send its media with it",
                                        code="cache_miss")
                self.publish_error(item)
                continue
            self.fetch_pool.submit(task, partial(self._fetched, item))

    def fetch_task(self, item: Item, spec: m.EncodeItem, blob: bytes | None) -> FetchTask:
        """How the fetch pool reads this item; sets the item's sampling and cache-key variant."""
        p = self.prep
        if item.modality == "video":
            item.sampling = sampling_for(p, spec.options or {})
            item.key_variant = "video:" + json.dumps(dataclasses.asdict(item.sampling), sort_keys=True)
            read = VideoRead(item.sampling, p.video_decode_threads, p.video_decode_backend, p.video_dali_decoders,
                             self.dali_device, p.max_video_duration_s,
                             p.max_source_pixels, p.max_video_decoded_bytes, p.video_decode_timeout_s)
            return FetchTask(spec.source, blob, video=read, timeout_s=self.video_timeout_s)
        if item.modality == "audio":
            if self.audio is None:
                raise MediaError("audio input is turned off on this server (--audio-model none)",
                                 code="unsupported_content")
            item.key_variant = f"audio:{self.audio.fingerprint}"
            return FetchTask(spec.source, blob, audio=AudioRead(p.max_audio_duration_s))
        if item.modality != "image":
            raise MediaError(f"unknown modality {item.modality!r}", code="unsupported_content")
        return FetchTask(spec.source, blob, keep_jpeg=self.backend != "pil")

    def publish_cached(self, item: Item, hit: tuple[str, torch.Tensor] | None) -> bool:
        """Answer `item` from the cache (no preprocessing, no forward). False on a miss."""
        if hit is None:
            return False
        key, tokens = hit  # vision: [t, h/m, w/m, D]; audio: [tokens, D]
        if tokens.dim() == 4:
            merge = self.model.cfg.spatial_merge_size
            self.set_grid(item, (tokens.shape[0], tokens.shape[1] * merge, tokens.shape[2] * merge))
        else:
            item.num_tokens = tokens.shape[0]
        item.timings_ms["cache"] = (time.perf_counter() - item.arrived) * 1e3
        full = tokens.reshape(-1, tokens.shape[-1]).float()  # [tokens, D]
        is_content_hit, item.content_key = item.content_key is not None, key
        self.publish(item, full.mean(0) if item.pooling == "mean" else full)
        if self.cache is not None and item.route_key and is_content_hit:
            self.cache.alias(item.route_key, key)
        return True

    def _fetched(self, item: Item, result: FetchResult) -> None:
        """Fetch-pool callback: size the item from its pixels or header, then queue it for a forward."""
        item.timings_ms.update(result.timings_ms)
        item.image, item.blob, item.error = result.image, result.blob, result.error
        item.frames, item.waveform = result.frames, result.waveform
        if item.error is None and self.cache is not None and result.digest:
            item.content_key = self.cache.content_key(result.digest, item.key_variant)
            if self.publish_cached(item, self.cache.get(item.content_key)):
                return
        if item.error is None:
            try:
                self.size(item)
            except MediaError as e:
                item.error = e
        if item.error is not None:
            self.publish_error(item)
            return
        self.publish_size(item)
        item.ready_at = time.perf_counter()
        self.queue_depth.inc()
        self.scheduler.put(item)

    def size(self, item: Item) -> None:
        """Set the item's grid and token counts from its fetched media (header size for JPEG bytes)."""
        p = self.prep
        if item.waveform is not None:
            item.window_tokens = audio_window_tokens(item.waveform.numel(), self.audio.cfg.max_source_positions)
            item.num_patches = len(item.window_tokens) * self.audio.cfg.max_source_positions
            item.num_tokens = sum(item.window_tokens)
        elif item.frames is not None:
            num_frames, height, width, _ = item.frames.shape
            h, w = frame_size(height, width, num_frames, item.sampling)
            self.set_grid(item, (-(-num_frames // p.temporal_patch_size), h // p.patch_size, w // p.patch_size))
        else:
            height, width = (item.image.shape[-2:] if item.image is not None
                             else displayed_size(item.blob, p.max_source_pixels))
            self.set_grid(item, self.grid_for(height, width))

    def set_grid(self, item: Item, grid: tuple[int, int, int]) -> None:
        item.grid = grid
        item.num_patches = grid[0] * grid[1] * grid[2]
        item.num_tokens = item.num_patches // self.model.cfg.merge_unit

    def grid_for(self, height: int, width: int) -> tuple[int, int, int]:
        p = self.prep
        h, w = smart_resize(height, width, p.resize_factor, p.min_pixels, p.max_pixels, p.max_aspect_ratio)
        return (1, h // p.patch_size, w // p.patch_size)

    # ------------------------------------------------------------------ encode loop

    def run(self) -> None:
        self.io.start()
        log.info("%s ready on %s (device %s, %s, decode %s)", self.name, self.io.address, self.device, self.dtype,
                 self.backend)
        in_flight: InFlight | None = None
        while True:
            batch = self.scheduler.next_batch(block=in_flight is None)
            if batch is None:
                break
            # NOTE: forward k+1 is prepared and queued on the device before forward k is collected, so
            # the device never waits for the host between forwards.
            prepared = self.prepare(batch) if batch else None
            launched = self.guarded(prepared.items, lambda p=prepared: self.launch(p)) if prepared else None
            if in_flight is not None:
                self.guarded(in_flight.items, lambda f=in_flight: self.finish(f))
            in_flight = launched
        if in_flight is not None:
            self.finish(in_flight)

    def guarded(self, items: list[Item], step: Callable[[], R]) -> R | None:
        """Run one pipeline step; if it raises (e.g. CUDA OOM) fail its items with 500 and keep serving."""
        try:
            return step()
        except Exception as e:
            log.exception("%s: a forward of %d items failed", self.name, len(items))
            for it in items:
                it.error = MediaError(f"encoder failed: {type(e).__name__}", code="internal", status=500)
                self.publish_error(it)
            return None

    def prepare(self, batch: list[Item]) -> Prepared | None:
        """Decode what is still compressed and build model inputs, on the upload stream."""
        start = time.perf_counter()
        self.queue_depth.dec(len(batch))
        for it in batch:
            it.timings_ms["queue"] = (start - it.ready_at) * 1e3
        stream = torch.cuda.stream(self.upload_stream) if self.upload_stream is not None else nullcontext()
        with stream:
            batch, inputs = self.model_inputs(batch)
            if inputs is None:
                return None
            ready = None
            if self.upload_stream is not None:
                ready = torch.cuda.Event()
                ready.record(self.upload_stream)
        prep_ms = (time.perf_counter() - start) * 1e3
        for it in batch:
            it.image = it.frames = it.waveform = None
            it.timings_ms["preprocess"] = prep_ms
        return Prepared(batch, inputs, ready, start)

    def model_inputs(self, batch: list[Item]) -> tuple[list[Item], EncodeInputs | None]:
        """(the items still alive, their model inputs) for one single-modality batch; failed items are
        published as errors here."""
        modality = batch[0].modality
        if modality == "audio":
            inputs = self.guarded(batch, lambda: audio_inputs([it.waveform for it in batch],
                                                              [it.window_tokens for it in batch],
                                                              self.audio.cfg.num_mel_bins, self.device))
            return batch, inputs
        if modality == "video":
            patches = []
            for it in list(batch):
                try:
                    patches.append(preprocess_video(it.frames, self.prep, it.sampling, self.device, self.dtype,
                                                    channels_last=True).pixel_values)  # [P_i, patch_dim]
                except MediaError as e:
                    it.error = e
                    self.publish_error(it)
            batch = [it for it in batch if it.error is None]
            pixel_values = torch.cat(patches) if patches else None
            return batch, EncodeInputs(pixel_values, [it.grid for it in batch]) if batch else None
        batch = self.decode_on_device(batch)
        if not batch:
            return batch, None
        images = self.guarded(batch, lambda: preprocess_images([it.image for it in batch], self.prep, self.device,
                                                               out_dtype=self.dtype))
        return batch, EncodeInputs(images.pixel_values, [it.grid for it in batch]) if images is not None else None

    def decode_on_device(self, batch: list[Item]) -> list[Item]:
        pending = [it for it in batch if it.image is None]
        if pending:
            start = time.perf_counter()
            decoded = decode_images([it.blob for it in pending], self.backend, self.device,
                                    self.prep.max_source_pixels)
            for it, out in zip(pending, decoded, strict=True):
                it.blob = None
                if isinstance(out, MediaError):
                    it.error = out
                    self.publish_error(it)
                else:
                    it.image = out
                    self.set_grid(it, self.grid_for(*out.shape[-2:]))  # the header's size but for broken EXIF
                    it.timings_ms["decode"] = (time.perf_counter() - start) * 1e3
        return [it for it in batch if it.error is None]

    @torch.inference_mode()
    def launch(self, prep: Prepared) -> InFlight:
        """Queue the forward and the pooling on the device; nothing waits for the device here."""
        inputs = prep.inputs
        if prep.ready is not None:
            torch.cuda.current_stream().wait_event(prep.ready)
            for t in (inputs.pixel_values, inputs.features):
                if t is not None:
                    t.record_stream(torch.cuda.current_stream())
        lengths = [it.num_tokens for it in prep.items]
        counts = to_device(torch.tensor(lengths), self.device)  # [N]
        item_ids = to_device(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)),
                              self.device)  # [T]
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True),
                  torch.cuda.Event()) if self.is_cuda else None
        started = time.perf_counter()
        if events:
            events[0].record()
        out = (audio_forward(self.audio.model, inputs) if inputs.features is not None
               else self.model(inputs.pixel_values, inputs.grids))  # [T, D]
        sums = torch.zeros(len(lengths), out.shape[1], device=out.device).index_add_(0, item_ids, out.float())  # [N, D]
        pooled = sums / counts[:, None]  # [N, D]
        if events:
            events[1].record()
        need_tokens = self.cache is not None or any(it.pooling == "none" for it in prep.items)
        pooled, tokens = to_host(pooled), to_host(out) if need_tokens else None
        if events:
            events[2].record()
        return InFlight(prep.items, pooled, tokens, lengths, events, time.perf_counter() - started)

    def finish(self, flight: InFlight) -> None:
        """Wait for the forward's results on the host, then publish each item."""
        if flight.events:
            flight.events[2].synchronize()  # this forward's copies only, not the forward queued after it
        pooled = flight.pooled  # [N, D]
        per_item = flight.tokens.split(flight.lengths) if flight.tokens is not None else None  # [tokens, D] each
        # NOTE: not the time until finish(): the next batch was prepared in between (the busy figure would pass 1)
        encode_s = (flight.events[0].elapsed_time(flight.events[1]) / 1e3 if flight.events
                    else flight.host_forward_s)
        metrics.FORWARDS.labels(self.name, flight.items[0].modality).inc()
        metrics.FORWARD_ITEMS.labels(self.name).observe(len(flight.items))
        metrics.FORWARD_TOKENS.labels(self.name).observe(sum(it.num_patches for it in flight.items))
        metrics.ENCODE_BUSY.labels(self.name).inc(encode_s)
        for i, it in enumerate(flight.items):
            it.timings_ms["encode"] = encode_s * 1e3
            start = time.perf_counter()
            if self.cache is not None and it.content_key and per_item is not None:
                entry = per_item[i]  # [tokens, D]; vision entries carry their grid: [t, h/m, w/m, D]
                if it.grid is not None:
                    t, h, w = it.grid
                    merge = self.model.cfg.spatial_merge_size
                    entry = entry.view(t, h // merge, w // merge, -1)
                # NOTE: a uuid item is written before its answer so that the client's next uuid-only request
                # hits; other items are queued to the writer thread (a miss there only costs a re-fetch).
                self.cache.put(it.route_key, it.content_key, entry, wait=it.has_uuid)
            self.publish(it, pooled[i] if it.pooling == "mean" else per_item[i].float())
            it.timings_ms["publish"] = (time.perf_counter() - start) * 1e3
            for stage, ms in it.timings_ms.items():
                metrics.STAGE_SECONDS.labels(stage).observe(ms / 1e3)

    # ------------------------------------------------------------------ results

    def _sender(self) -> zmq.Socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._local.sock = self.io.sender()
        return sock

    def publish_size(self, it: Item) -> None:
        """Tell a reply_to receiver the item's token count (once, before its embedding)."""
        if it.wants_size:
            it.wants_size = False
            sized = m.ItemSized(it.request_id, it.index, it.modality, it.num_tokens, it.grid, it.content_key or "")
            self._sender().send_multipart([it.identity, m.pack(sized)])

    def publish(self, it: Item, tensor: torch.Tensor) -> None:
        self.publish_size(it)
        header = m.ItemResult(it.request_id, it.index, dtype="float32", shape=tuple(tensor.shape), grid_thw=it.grid,
                              num_tokens=it.num_tokens,
                              timings_ms={k: round(v, 3) for k, v in it.timings_ms.items()})
        self._sender().send_multipart([it.identity, m.pack(header), m.tensor_frame(tensor)], copy=False)

    def publish_error(self, it: Item) -> None:
        err = it.error or MediaError("unknown error", code="internal", status=500)
        metrics.ERRORS.labels(err.code).inc()
        header = m.ItemResult(it.request_id, it.index, error_code=err.code, error_message=err.message,
                              error_status=err.status)
        self._sender().send_multipart([it.identity, m.pack(header)])

    def stop(self) -> None:
        self.scheduler.close()
        self.fetch_pool.close()
        if self.cache is not None:
            self.cache.close()


def worker_main(index: int, address: str, worker: WorkerConfig, prep: PreprocessConfig, fetch: FetchConfig,
                log_level: str = "info") -> None:
    """Process entry point (spawned by the supervisor)."""
    import signal

    from encoder_server.logs import die_with_parent, set_process_name, setup_logging

    # NOTE: Ctrl-C reaches the whole process group; the supervisor decides, and stops us with SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    set_process_name(f"mmenc-worker-{index}")
    setup_logging(log_level)
    w = EncoderWorker(index, address, worker, prep, fetch)
    signal.signal(signal.SIGTERM, lambda *_: w.scheduler.close())  # the loop finishes what is in flight
    try:
        w.run()
    finally:
        w.stop()  # fetch processes, then pending cache writes
        log.info("%s stopped", w.name)
