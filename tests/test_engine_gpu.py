"""The engine on CUDA agrees with the engine on CPU (no transformers needed: the GPU box may lack MiMo)."""

from __future__ import annotations

import pytest
import torch

from engine_link.engine import LLM, MODEL_PRESETS, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CFG = MODEL_PRESETS["tiny"]


def test_cuda_fp32_matches_cpu_and_bf16_runs() -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist() for n in (3, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=3 * CFG.sliding_window, return_logits=True)
    cpu = LLM("tiny", device="cpu", max_prefill_tokens=16).generate(prompts, params)
    cuda = LLM("tiny", device="cuda", dtype="float32", max_prefill_tokens=16).generate(prompts, params)
    for a, b in zip(cpu, cuda, strict=True):
        assert a.token_ids == b.token_ids
        assert (a.logits - b.logits).abs().max().item() < 1e-3  # TF32 off by default for matmul in fp32
    bf16 = LLM("tiny", device="cuda", dtype="bfloat16").generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    assert all(len(o.token_ids) == 8 for o in bf16)
