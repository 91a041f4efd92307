"""`mmenc bench engine-ops`: what one decode step of the engine costs in dispatched operations.

On a GPU at small batch a decode step is bound by how many kernels Python launches, not by FLOPs; the count
of top-level aten ops per step is the same on any machine, so it can be measured here. `mid-narrow` is the
`mid` preset's structure (24 layers, 32 experts top-4, window 128, its head counts) at width 128, random
weights; `--save DIR` writes it (config + safetensors) for `mmenc bench engine --model DIR`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from engine_link.engine import LLM, SamplingParams
from engine_link.engine.config import MODEL_PRESETS
from engine_link.engine.loader import save_model
from engine_link.engine.model import MiMoV2FlashForCausalLM, init_random


def mid_narrow() -> MiMoV2FlashForCausalLM:
    cfg = dataclasses.replace(MODEL_PRESETS["mid"], hidden_size=128, intermediate_size=256, moe_intermediate_size=32,
                              num_attention_heads=8, num_key_value_heads=1, head_dim=32, v_head_dim=16,
                              vocab_size=1024)
    model = MiMoV2FlashForCausalLM(cfg)
    init_random(model, 0)
    return model


def step_cost(model: MiMoV2FlashForCausalLM, batch: int, prompt_len: int, steps: int) -> tuple[float, int]:
    """(ms per decode step, top-level aten ops in one decode step) with `batch` sequences decoding."""
    from torch.profiler import ProfilerActivity, profile

    llm = LLM(model, num_full_slots=batch * (prompt_len + steps + 16) + 64, device="cpu", dtype="float32",
              enable_prefix_cache=False)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True)
    for _ in range(batch):
        llm.add_request(torch.randint(0, model.cfg.vocab_size, (prompt_len,), generator=gen).tolist(), params)
    while any(s.num_computed < prompt_len for s in llm._requests.values()):  # prefill
        llm.step()
    for _ in range(3):
        llm.step()
    start = time.perf_counter()
    for _ in range(steps):
        llm.step()
    ms = (time.perf_counter() - start) / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.step()
    ops = [e for e in prof.events() if e.name.startswith("aten::")
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    return ms, len(ops)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mmenc bench engine-ops", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,16")
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save", metavar="DIR", help="write the mid-narrow model to DIR and exit")
    a = p.parse_args(argv)
    model = mid_narrow()
    if a.save:
        save_model(model, a.save)
        print(f"wrote the mid-narrow model to {a.save}")
        return 0
    torch.set_num_threads(1)
    model.prepare(torch.device("cpu"), torch.float32)
    for batch in (int(b) for b in a.batches.split(",") if b):
        ms, ops = step_cost(model, batch, a.prompt_len, a.steps)
        print(f"mid-narrow, batch {batch}: {ops} aten ops per decode step, {ms:.1f} ms per step (CPU, 1 thread)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
