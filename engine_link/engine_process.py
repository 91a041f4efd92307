"""The engine process (`mmenc-engine`): chat/completion requests from the gateway -> tokens streamed back.

Sockets live on IO threads: a ROUTER for the gateway (`Generate`, `Abort`, pings) and the `EncoderLink`
(media items out to the encoder fleet, sizes and embeddings pushed back). Both feed one inbox queue; the
loop below only reads that queue and steps the `LLM`:

    handle everything in the inbox (block on it when idle) -> llm.step() -> stream each request's new tokens

Overlap: a request with media is laid out and admitted as soon as every item's size is known (workers send
it right after fetch/probe, before the forward): one placeholder run per item, of its token count, keyed
for the prefix cache by the embedding's cache key. The LLM prefills the text up to the first run whose
embedding is still missing; each embedding is injected the moment it arrives. A failed item fails its
request with the item's own status and reason. Stop strings are matched on the decoded text.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from encoder_server import messages as m
from engine_link import protocol as p
from engine_link.chat_tokenizer import Tokenizer, Turn, load_chat_tokenizer, render_chat
from engine_link.engine import LLM, Prompt, SamplingParams, StepOutput
from engine_link.link import EncoderLink, ItemEvent, LinkConfig
from engine_link.projector import Projector

log = logging.getLogger(__name__)


@dataclass
class _Request:
    identity: bytes
    msg: p.Generate
    params: SamplingParams
    arrived: float
    sizes: dict[int, tuple[int, str]] = field(default_factory=dict)  # item -> (tokens, content key)
    embeddings: dict[int, torch.Tensor] = field(default_factory=dict)  # arrived before admission
    modality: dict[int, str] = field(default_factory=dict)
    run_start: dict[int, int] = field(default_factory=dict)  # item -> first position of its run (once admitted)
    num_embedded: int = 0
    is_admitted: bool = False
    prompt_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    sent_text: str = ""
    timings_ms: dict[str, float] = field(default_factory=dict)


class EngineIO:
    """The gateway-facing ROUTER on its own thread: messages in go to `inbox` as ("msg", identity, msg, frames);
    `send` (any thread) queues an outgoing message."""

    def __init__(self, address: str, inbox: queue.Queue) -> None:
        self.ctx = zmq.Context.instance()
        self.inbox = inbox
        self._router = self.ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(address)
        self._out_address = f"inproc://engine-out-{uuid.uuid4().hex}"
        self._out = self.ctx.socket(zmq.PULL)
        self._out.bind(self._out_address)
        self._local = threading.local()
        threading.Thread(target=self._serve, name="engine-io", daemon=True).start()

    def send(self, identity: bytes, msg: Any) -> None:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._local.sock = self.ctx.socket(zmq.PUSH)
            sock.connect(self._out_address)
        sock.send_multipart([identity, p.pack(msg)])

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._out, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._out in events:
                self._router.send_multipart(self._out.recv_multipart(copy=False), copy=False)
            if self._router in events:
                frames = self._router.recv_multipart(copy=False)
                identity = frames[0].bytes
                try:
                    msg = p.unpack(frames[1].bytes if len(frames) > 1 else b"")
                except ValueError as e:
                    log.warning("dropping a malformed message from the gateway: %s", e)
                    continue
                self.inbox.put(("msg", identity, msg, [f.bytes for f in frames[2:]]))


class EngineServer:
    def __init__(self, address: str, workers: list[str], model: str, overlap: bool = True,
                 link: LinkConfig | None = None, **overrides: Any) -> None:
        self.inbox: queue.Queue = queue.Queue()
        self.overlap = overlap  # admit on sizes (True) or only once every embedding is in
        self.llm = LLM(model, **overrides)
        cfg = self.llm.model_config
        self.tok: Tokenizer = load_chat_tokenizer(model, cfg.vocab_size)
        self.projector = Projector(cfg.hidden_size, self.llm.device, self.llm.dtype, seed=cfg.seed)
        self.link = EncoderLink(workers, cfg=link, events=self.inbox) if workers else None
        self.ready = p.EngineReady(model, cfg.vocab_size, cfg.hidden_size, os.getpid())
        self.requests: dict[str, _Request] = {}
        start = time.perf_counter()
        self.llm.generate([[cfg.bos_token_id or 0] * 4], SamplingParams(temperature=0, max_tokens=2))  # warm-up
        log.info("engine warm-up took %.1f s", time.perf_counter() - start)
        self.io = EngineIO(address, self.inbox)
        log.info("engine ready on %s (%s, %s, %s)", address, model, self.llm.device, self.llm.dtype)

    def run(self) -> None:
        while True:
            block = not self.llm.has_runnable()
            try:
                event = self.inbox.get(block=block)
            except queue.Empty:
                event = None
            while event is not None:
                if event == "stop":
                    return
                try:
                    self.handle(event)
                except Exception:  # NOTE: one malformed message must not take the engine (and all requests) down
                    log.exception("engine: failed to handle %s", type(event).__name__)
                try:
                    event = self.inbox.get_nowait()
                except queue.Empty:
                    event = None
            if self.llm.has_runnable():
                for out in self.llm.step():
                    self.on_step(out)

    # ------------------------------------------------------------------------------------------ inbox
    def handle(self, event: Any) -> None:
        if isinstance(event, ItemEvent):
            self.on_item(event)
            return
        _, identity, msg, frames = event
        if isinstance(msg, m.Ping):
            usage = self.llm.scheduler.usage()
            self.io.send(identity, dataclasses.replace(self.ready, num_requests=len(self.requests),
                                                       kv_full_used=usage["full_used"],
                                                       kv_swa_used=usage["swa_used"]))
        elif isinstance(msg, p.Generate):
            self.on_generate(identity, msg, frames)
        elif isinstance(msg, p.Abort):
            self.on_abort(msg.request_id)

    def on_generate(self, identity: bytes, msg: p.Generate, frames: list[bytes]) -> None:
        if msg.request_id in self.requests:
            self.io.send(identity, p.TokenDelta(msg.request_id, finished=True, error_code="invalid_request",
                                                error_message="duplicate request id", error_status=400))
            return
        try:
            stop_ids = () if msg.sampling.get("ignore_eos") else tuple(self.tok.eos_ids)
            params = SamplingParams(**msg.sampling, stop_token_ids=stop_ids)
        except (TypeError, ValueError) as e:
            self.io.send(identity, p.TokenDelta(msg.request_id, finished=True, error_code="invalid_request",
                                                error_message=str(e), error_status=400))
            return
        req = _Request(identity, msg, params, time.perf_counter())
        self.requests[msg.request_id] = req
        if not msg.items:
            self.admit(req)
            return
        if self.link is None:
            self.fail(req, "unsupported_content", "this engine has no encoder fleet for media", 400)
            return
        if sum(it.inline for it in msg.items) != len(frames):
            self.fail(req, "invalid_request", "inline media count does not match the request's frames", 400)
            return
        inline = iter(frames)
        blobs = {it.index: next(inline) for it in msg.items if it.inline}
        req.modality = {it.index: it.modality for it in msg.items}
        self.link.submit(msg.request_id, list(msg.items), blobs)

    def on_item(self, ev: ItemEvent) -> None:
        req = self.requests.get(ev.request_id)
        if req is None:
            return  # failed or aborted already
        if ev.kind == "error":
            self.fail(req, ev.error_code, ev.error_message, ev.error_status, item=ev.index)
        elif ev.kind == "sized":
            req.sizes[ev.index] = (ev.num_tokens, ev.content_key)
            if len(req.sizes) == len(req.msg.items):
                req.timings_ms["sized"] = (time.perf_counter() - req.arrived) * 1e3
                if self.overlap or len(req.embeddings) == len(req.msg.items):
                    self.admit(req)
        elif ev.kind == "embedding":
            embedding = self.projector(req.modality[ev.index], ev.embedding)  # [tokens, hidden]
            if req.is_admitted:
                self.inject(req, ev.index, embedding)
            else:
                req.embeddings[ev.index] = embedding
                if not self.overlap and len(req.embeddings) == len(req.msg.items) == len(req.sizes):
                    self.admit(req)

    def inject(self, req: _Request, item: int, embedding: torch.Tensor) -> None:
        """Hand an arrived embedding to the LLM (prefill continues past its run at the next step)."""
        try:
            self.llm.add_embeds(req.msg.request_id, req.run_start[item], embedding)
        except ValueError as e:  # e.g. a token count other than the size the worker announced
            self.fail(req, "internal", f"embedding does not fit its placeholder run: {e}", 500, item=item)
            return
        req.num_embedded += 1
        if req.num_embedded == len(req.msg.items):
            req.timings_ms["encode"] = (time.perf_counter() - req.arrived) * 1e3

    def on_abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None and req.is_admitted:
            self.llm.abort(request_id)

    # ------------------------------------------------------------------------------------------ engine
    def admit(self, req: _Request) -> None:
        """Lay out the prompt (placeholder runs of the announced sizes) and hand it to the LLM; embeddings that
        already arrived go in at once, the others when they come. A 400 says why a prompt cannot run."""
        msg = req.msg
        embeds: list[tuple[int, int]] = []
        keys: list[str | None] = []
        if msg.turns is not None:
            turns = [Turn(t["role"], tuple(t["parts"])) for t in msg.turns]
            ids, runs = render_chat(turns, {i: n for i, (n, _) in req.sizes.items()}, req.modality, self.tok)
            embeds = [(run.start, run.length) for run in runs]
            keys = [req.sizes[run.item][1] or None for run in runs]
            req.run_start = {run.item: run.start for run in runs}
        elif msg.prompt_token_ids is not None:
            ids = list(msg.prompt_token_ids)
        else:
            ids = self.tok.encode(msg.prompt_text or "")
        req.prompt_tokens = len(ids)
        try:
            self.llm.add_request(Prompt(ids, embeds, keys if embeds else None), req.params, request_id=msg.request_id)
        except ValueError as e:
            self.fail(req, "invalid_request", str(e), 400)
            return
        req.is_admitted = True
        for item, embedding in list(req.embeddings.items()):
            self.inject(req, item, embedding)
        req.embeddings.clear()

    def on_step(self, out: StepOutput) -> None:
        req = self.requests.get(out.request_id)
        if req is None:
            return  # aborted by the gateway
        if req.timings_ms.get("first_token") is None and out.new_token_ids:
            req.timings_ms["first_token"] = (time.perf_counter() - req.arrived) * 1e3
        req.output_ids += out.new_token_ids
        text = self.tok.decode(req.output_ids)
        finished, reason = out.finished, out.finish_reason
        stop_at = min((i for s in req.msg.stop if (i := text.find(s, max(0, len(req.sent_text) - len(s)))) >= 0),
                      default=-1)
        if stop_at >= 0:
            text, finished, reason = text[:stop_at], True, "stop"
            if not out.finished:
                self.llm.abort(out.request_id)
        elif not finished and text.endswith("\ufffd"):
            return  # NOTE: an incomplete UTF-8 character: wait for its next bytes
        delta = text[len(req.sent_text):]
        req.sent_text = text
        if not finished:
            self.io.send(req.identity, p.TokenDelta(out.request_id, out.new_token_ids, delta))
            return
        del self.requests[out.request_id]
        cached = out.output.num_cached_tokens if out.output is not None else 0
        req.timings_ms["total"] = (time.perf_counter() - req.arrived) * 1e3
        self.io.send(req.identity, p.TokenDelta(
            out.request_id, out.new_token_ids, delta, finished=True, finish_reason=reason if reason != "abort"
            else "stop", prompt_tokens=req.prompt_tokens, completion_tokens=len(req.output_ids), cached_tokens=cached,
            timings_ms={k: round(v, 3) for k, v in req.timings_ms.items()}))

    def fail(self, req: _Request, code: str, message: str, status: int, item: int | None = None) -> None:
        if self.requests.pop(req.msg.request_id, None) is not None and req.is_admitted:
            self.llm.abort(req.msg.request_id)  # e.g. one of its items failed after the text was prefilled
        self.io.send(req.identity, p.TokenDelta(req.msg.request_id, finished=True, error_code=code,
                                                error_message=message, error_status=status, error_item=item))


def engine_main(address: str, workers: list[str], model: str, overrides: dict[str, Any],
                log_level: str = "info", overlap: bool = True, route_balance: float = 1.25) -> None:
    """Process entry point (spawned by the supervisor)."""
    import signal

    from encoder_server.logs import die_with_parent, set_process_name, setup_logging

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor stops us with SIGTERM
    die_with_parent()
    set_process_name("mmenc-engine")
    setup_logging(log_level)
    server = EngineServer(address, workers, model, overlap, LinkConfig(route_balance=route_balance), **overrides)
    signal.signal(signal.SIGTERM, lambda *_: server.inbox.put("stop"))
    server.run()
    if server.link is not None:
        server.link.close()
    log.info("engine stopped")
