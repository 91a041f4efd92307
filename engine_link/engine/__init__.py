"""Bundled prefill/decode engine: MiMo-V2-Flash (hybrid SWA + MoE) over dual KV pools with an SWA-aware
prefix cache, chunked prefill and continuous batching.

    from engine_link.engine import LLM, Prompt, SamplingParams
    llm = LLM("tiny")                                   # or "mid", or a save_pretrained directory
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8))[0].token_ids

Serving loop (one thread owns the engine): `add_request(prompt, params)` -> id; `step()` -> StepOutputs
(new tokens; the finishing one carries the RequestOutput); `abort(id)`; `add_embeds(id, start, tensor)` for an
embedding run queued as `Prompt(ids, embeds=[(start, n)], embed_keys=[media_key])` before it was encoded.

Files: config (frozen configs, presets), model/attention/moe/layers (the network over slot-addressed KV),
kv_cache (pool tensors, per-request slot tables), kv_pool (slot allocators), radix (SWA-aware prefix tree),
policy (waiting order), scheduler, runner, sampling, sequence, loader, llm (the API).
"""

from engine_link.engine.config import MODEL_PRESETS, EngineConfig, EngineModelConfig
from engine_link.engine.llm import LLM, Prompt, RequestOutput, StepOutput
from engine_link.engine.sampling import SamplingParams

__all__ = ["LLM", "MODEL_PRESETS", "EngineConfig", "EngineModelConfig", "Prompt", "RequestOutput",
           "SamplingParams", "StepOutput"]
