"""Offline engine API (nano-vllm / vLLM style).

    llm = LLM("tiny", max_prefill_tokens=256)
    outs = llm.generate([[1, 2, 3], Prompt([5, 0, 0, 6], embeds=[(1, image_embeds)])], SamplingParams(max_tokens=8))
    outs[0].token_ids

Streaming: `add_request(...)` then `step()` until `has_unfinished()` is False; each step returns the new
tokens per request (`StepOutput`; the finishing one carries the `RequestOutput`). `abort(request_id)` between
steps (not thread-safe: a server calls it from the loop's thread, e.g. from a command queue). The loop is the algorithm:
`batch = scheduler.schedule(); tokens = runner.run(batch); scheduler.postprocess(batch, tokens)`.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from engine_link.engine.config import EngineConfig
from engine_link.engine.kv_cache import KVCache
from engine_link.engine.loader import load_model, load_tokenizer, resolve_device, resolve_dtype
from engine_link.engine.model import MiMoV2FlashForCausalLM
from engine_link.engine.runner import ModelRunner
from engine_link.engine.sampling import SamplingParams
from engine_link.engine.scheduler import Scheduler
from engine_link.engine.sequence import EmbedSegment, Sequence, Status, content_key_of


@dataclass(frozen=True)
class Prompt:
    """Token ids with optional embedding runs: `embeds[i] = (start, tensor [n, hidden])` replaces the token
    embeddings of positions start..start+n-1 (the ids there are placeholders). `(start, n)` queues a run that
    is still being encoded: prefill stops before it until `LLM.add_embeds(request_id, start, tensor)`.
    `embed_keys[i]`, optional, identifies the media of run i for the prefix cache (e.g. its content hash;
    default: a hash of the tensor's bytes once it is there)."""

    token_ids: list[int]
    embeds: list[tuple[int, torch.Tensor | int]] = field(default_factory=list)
    embed_keys: list[int | bytes | str] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int  # prompt tokens reused from the prefix cache (last admission)
    num_preemptions: int
    text: str | None = None
    logits: torch.Tensor | None = None  # [num_generated, V] float32 when SamplingParams.return_logits
    ttft_s: float | None = None  # seconds from add_request to the first token


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    output: RequestOutput | None = None  # the whole output, on the request's finishing step


class LLM:
    """Args:
        model: a preset name ("tiny", "mid"), a transformers `save_pretrained` directory, or a loaded model
            (its device and dtype win over the `device`/`dtype` options).
        **overrides: `EngineConfig` fields (num_full_slots, num_swa_slots, max_num_seqs, max_prefill_tokens,
            enable_prefix_cache, policy, device, dtype, seed, ...).
    """

    def __init__(self, model: str | MiMoV2FlashForCausalLM = "tiny", **overrides: Any) -> None:
        self.config = EngineConfig().with_overrides(**overrides)
        if isinstance(model, MiMoV2FlashForCausalLM):  # share loaded weights (e.g. to compare engine settings)
            self.model = model
            param = next(model.parameters())
            self.device, self.dtype = param.device, param.dtype
        else:
            self.device = resolve_device(self.config.device)
            self.dtype = resolve_dtype(self.config.dtype, self.device)
            self.model = load_model(model, self.device, self.dtype)
        self.model_config = self.model.cfg
        self.config.check_model(self.model_config)
        self.kv = KVCache(self.model_config, self.config.num_full_slots, self.config.swa_slots_for(self.model_config),
                          self.device, self.dtype)
        self.scheduler = Scheduler(self.model_config, self.config)
        self.runner = ModelRunner(self.model, self.kv, self.device)
        self.tokenizer = load_tokenizer(model) if isinstance(model, str) else None
        self._generator = torch.Generator(self.device).manual_seed(self.config.seed)
        self._requests: dict[str, Sequence] = {}  # unfinished requests
        self._aborted: list[Sequence] = []  # aborted since the last step

    # ------------------------------------------------------------------------------------------- requests
    def add_request(self, prompt: Seq[int] | Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one request; returns its id.

        Raises:
            ValueError: empty prompt, token id outside the vocabulary, a bad embedding run, or a prompt plus
                max_tokens that the full KV pool (or the position limit) cannot hold.
        """
        return self._enqueue([self._make(prompt, params, request_id)])[0]

    def _enqueue(self, seqs: list[Sequence]) -> list[str]:
        for seq in seqs:
            self._requests[seq.request_id] = seq
            self.scheduler.add(seq)
        return [seq.request_id for seq in seqs]

    def _make(self, prompt: Seq[int] | Prompt, params: SamplingParams | None, request_id: str | None) -> Sequence:
        """A validated Sequence (not queued yet)."""
        params = params or SamplingParams()
        if isinstance(prompt, int | str):
            raise ValueError(f"a prompt is a list of token ids or a Prompt, got {type(prompt).__name__} "
                             "(generate() takes a list of prompts)")
        prompt = prompt if isinstance(prompt, Prompt) else Prompt(list(prompt))
        token_ids = [int(t) for t in prompt.token_ids]
        cfg = self.model_config
        if not token_ids:
            raise ValueError("empty prompt: need at least one token")
        bad = [t for t in token_ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {cfg.vocab_size})")
        capacity = min(self.config.num_full_slots, cfg.max_position_embeddings)
        if len(token_ids) + params.max_tokens > capacity:
            raise ValueError(f"prompt of {len(token_ids)} tokens + max_tokens {params.max_tokens} exceeds the "
                             f"KV capacity of {capacity} tokens (num_full_slots / max_position_embeddings)")
        segments = self._segments(prompt, len(token_ids))
        seq = Sequence(token_ids, params, segments, key_offset=cfg.vocab_size)
        if request_id is not None:
            if request_id in self._requests:
                raise ValueError(f"duplicate request id {request_id!r}")
            seq.request_id = request_id
        if not params.is_greedy:
            seq.generator = (torch.Generator(self.device).manual_seed(params.seed) if params.seed is not None
                             else self._generator)
        return seq

    def _segments(self, prompt: Prompt, num_tokens: int) -> list[EmbedSegment]:
        keys = prompt.embed_keys if prompt.embed_keys is not None else [None] * len(prompt.embeds)
        if len(keys) != len(prompt.embeds):
            raise ValueError("embed_keys needs one key per embedding run")
        segments, end = [], 0
        for (start, values), key in sorted(zip(prompt.embeds, keys, strict=True), key=lambda item: item[0][0]):
            if isinstance(values, int):
                length, values = values, None
            else:
                values = self._check_embeds(start, values)
                length = values.shape[0]
            if length < 1 or start < end or start + length > num_tokens:
                raise ValueError(f"embedding run at {start} (+{length}) is empty, overlaps another or the end")
            segments.append(EmbedSegment(start, length, values, content_key_of(key, values)))
            end = start + length
        return segments

    def _check_embeds(self, start: int, values: torch.Tensor, length: int | None = None) -> torch.Tensor:
        hidden = self.model_config.hidden_size
        if values.dim() != 2 or values.shape[1] != hidden or (length is not None and values.shape[0] != length):
            raise ValueError(f"embedding run at {start}: shape {tuple(values.shape)}, expected "
                             f"[{length or 'n'}, {hidden}]")
        return values.to(self.device)

    def add_embeds(self, request_id: str, start: int, values: torch.Tensor) -> None:
        """Provide a pending embedding run (queued as `(start, length)`); prefill continues past it next step.

        Raises:
            ValueError: unknown request, no pending run at `start`, or a shape other than [length, hidden].
        """
        seq = self._requests.get(request_id)
        seg = next((s for s in seq.embeds if s.start == start), None) if seq is not None else None
        if seg is None or seg.values is not None:
            raise ValueError(f"request {request_id!r} has no pending embedding run at {start}")
        seg.values = self._check_embeds(start, values, seg.length)
        if seg.content_key is None:
            seg.content_key = content_key_of(None, seg.values)

    def abort(self, request_id: str) -> bool:
        """Stop a request now (its KV goes to the prefix cache); the next `step()` reports it finished with
        reason "abort". False if it is unknown or already finished."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        self._aborted.append(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._aborted)

    def has_runnable(self) -> bool:
        """Whether `step()` can make progress now (False while every request waits for an embedding): a serving
        loop blocks on its inbox when this is False."""
        return self.scheduler.has_runnable() or bool(self._aborted)

    # ------------------------------------------------------------------------------------------- loop
    def step(self) -> list[StepOutput]:
        """One forward. Returns the new token of every request that got one, and the requests aborted since the
        last step; a finished request (`.finished`) carries its `RequestOutput` and is forgotten here."""
        batch = self.scheduler.schedule()
        tokens = self.runner.run(batch)
        updated = self.scheduler.postprocess(batch, tokens)
        outs = [self._step_output(s, [s.output[-1]]) for s in updated]
        outs += [self._step_output(s, []) for s in self._aborted]
        self._aborted.clear()
        return outs

    def _step_output(self, seq: Sequence, new_tokens: list[int]) -> StepOutput:
        finished = seq.status is Status.FINISHED
        if finished:
            self._requests.pop(seq.request_id, None)
        return StepOutput(seq.request_id, new_tokens, finished, seq.finish_reason,
                          self._output(seq) if finished else None)

    def stream(self, prompts: Seq[Seq[int] | Prompt], params: SamplingParams | Seq[SamplingParams] | None = None
               ) -> Iterator[StepOutput]:
        """Queue `prompts` and yield their tokens as they are generated (request ids: `StepOutput.request_id`)."""
        self._enqueue([self._make(prompt, p, None) for prompt, p in zip(prompts, self._params(params, len(prompts)),
                                                                         strict=True)])
        while self.has_unfinished():
            yield from self.step()

    def generate(self, prompts: Seq[Seq[int] | Prompt], params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run `prompts` to completion; outputs in prompt order. All prompts are validated before any is queued.

        Raises:
            ValueError: as `add_request`, or a pending embedding run (use add_request / add_embeds / step).
        """
        seqs = [self._make(prompt, p, None) for prompt, p in zip(prompts, self._params(params, len(prompts)),
                                                                 strict=True)]
        if any(seg.values is None for seq in seqs for seg in seq.embeds):
            raise ValueError("generate() needs every embedding run; queue pending ones with add_request()")
        self._enqueue(seqs)
        while self.has_unfinished():
            self.step()
        return [self._output(seq) for seq in seqs]

    def output(self, request_id: str) -> RequestOutput:
        """The output so far of an unfinished request (a finished one comes with its last StepOutput)."""
        return self._output(self._requests[request_id])

    def _output(self, seq: Sequence) -> RequestOutput:
        text = self.tokenizer.decode(seq.output) if self.tokenizer is not None else None
        logits = torch.stack(seq.logits) if seq.logits else None
        ttft = seq.first_token_at - seq.arrival if seq.first_token_at is not None else None
        return RequestOutput(seq.request_id, seq.prompt, list(seq.output), seq.finish_reason, seq.num_cached,
                             seq.num_preemptions, text, logits, ttft)

    @staticmethod
    def _params(params: SamplingParams | Seq[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * n
        if len(params) != n:
            raise ValueError(f"{len(params)} sampling params for {n} prompts")
        return list(params)
