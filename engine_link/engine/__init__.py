"""Bundled prefill/decode engine: MiMo-V2-Flash (hybrid SWA + MoE) over dual KV pools with an SWA-aware
prefix cache, chunked prefill and continuous batching.

    from engine_link.engine import LLM, SamplingParams
    LLM("tiny").generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8))[0].token_ids
"""

from engine_link.engine.config import MODEL_PRESETS, EngineConfig, EngineModelConfig
from engine_link.engine.llm import LLM, Prompt, RequestOutput, StepOutput
from engine_link.engine.sampling import SamplingParams

__all__ = ["LLM", "MODEL_PRESETS", "EngineConfig", "EngineModelConfig", "Prompt", "RequestOutput",
           "SamplingParams", "StepOutput"]
