"""The engine against transformers' eager MiMoV2FlashForCausalLM with the same weights (CPU, fp32, tiny).

Each check teacher-forces transformers on prompt + generated tokens in one full forward: our greedy token
at every step must be its argmax, and our logits must be within ATOL of its logits at that position.
Measured max |diff| on these tests: 5.4e-6 (logits of magnitude up to ~4).
"""

from __future__ import annotations

import pytest
import torch

from engine_link.engine import LLM, MODEL_PRESETS, SamplingParams

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny shapes gain nothing from intra-op threads, and a busy 2-core box stalls them badly."""
    num = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num)

ATOL = 1e-4
CFG = MODEL_PRESETS["tiny"]
W = CFG.sliding_window


@pytest.fixture(scope="module")
def ref():
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

    llm = LLM("tiny")
    hf_cfg = MiMoV2FlashConfig(**CFG.to_hf_dict())
    hf_cfg._attn_implementation = "eager"
    model = MiMoV2FlashForCausalLM(hf_cfg)
    model.load_state_dict(llm.model.state_dict(), strict=True)
    return model.eval()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, return_logits=True)


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_against(ref, prompt: list[int], out) -> float:
    """Our tokens are transformers' greedy choice and our logits its logits; returns the max |diff|."""
    seq = prompt + out.token_ids[:-1]
    with torch.no_grad():
        logits = ref(torch.tensor([seq])).logits[0, len(prompt) - 1:]  # [num_generated, V]
    assert out.logits is not None and out.logits.shape == logits.shape
    diff = (out.logits - logits).abs().max().item()
    assert diff < ATOL, diff
    assert logits.argmax(-1).tolist() == out.token_ids
    return diff


def test_single_prompt_matches_transformers_generate(ref) -> None:
    prompt = prompt_of(11, 0)
    out = LLM("tiny").generate([prompt], greedy(12))[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    check_against(ref, prompt, out)
    with torch.no_grad():  # and transformers' own cached generate loop agrees
        hf = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
    assert hf.tolist() == out.token_ids


def test_batch_of_mixed_lengths(ref) -> None:
    prompts = [prompt_of(n, i) for i, n in enumerate((1, 5, 9, 17, 30))]
    outs = LLM("tiny", max_prefill_tokens=64).generate(prompts, greedy(10))
    for prompt, out in zip(prompts, outs, strict=True):
        check_against(ref, prompt, out)


def test_chunked_prefill_across_the_window(ref) -> None:
    prompts = [prompt_of(3 * W + 5, 10), prompt_of(2 * W - 1, 11)]
    llm = LLM("tiny", max_prefill_tokens=5, num_swa_slots=64)
    outs = llm.generate(prompts, greedy(6))
    for prompt, out in zip(prompts, outs, strict=True):
        check_against(ref, prompt, out)


def test_generation_well_past_the_window(ref) -> None:
    prompt = prompt_of(W + 3, 20)
    out = LLM("tiny", swa_release_interval=3).generate([prompt], greedy(6 * W))[0]
    assert len(out.token_ids) == 6 * W
    check_against(ref, prompt, out)


def test_prefix_cache_hit_is_identical_to_recompute(ref) -> None:
    system = prompt_of(3 * W, 30)
    turn1 = system + prompt_of(4, 31)
    cached, plain = LLM("tiny", max_prefill_tokens=16), LLM("tiny", max_prefill_tokens=16, enable_prefix_cache=False)
    first = cached.generate([turn1], greedy(5))[0]
    turn2 = turn1 + first.token_ids + prompt_of(6, 32)  # multi-turn: the whole first exchange is the prefix
    second = cached.generate([turn2], greedy(8))[0]
    assert second.num_cached_tokens == len(turn1) + len(first.token_ids) - 1  # all but the last sampled token
    check_against(ref, turn2, second)
    baseline = plain.generate([turn2], greedy(8))[0]
    assert baseline.num_cached_tokens == 0
    assert baseline.token_ids == second.token_ids
    assert torch.allclose(baseline.logits, second.logits, atol=ATOL)


def test_same_prompt_twice_reuses_all_but_its_last_token(ref) -> None:
    """The prompt's KV (SWA of its last window included) is cached when its prefill ends, so the same prompt again
    recomputes only its last token (whose logits it needs)."""
    prompt = prompt_of(3 * W + 3, 33)
    cached = LLM("tiny", max_prefill_tokens=8)
    first = cached.generate([prompt], greedy(6))[0]
    second = cached.generate([prompt], greedy(6))[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == len(prompt) - 1
    baseline = LLM("tiny", enable_prefix_cache=False).generate([prompt], greedy(6))[0]
    assert second.token_ids == first.token_ids == baseline.token_ids
    assert torch.allclose(second.logits, baseline.logits, atol=ATOL)
    check_against(ref, prompt, second)


def test_shared_system_prompt_is_reused_by_a_different_user_turn(ref) -> None:
    """Two prompts share a system prompt longer than the window, then differ: the second reuses the whole shared
    part, because every prefill chunk went into the tree with its SWA (the first request ran on meanwhile)."""
    system = prompt_of(3 * W, 40)
    llm = LLM("tiny", max_prefill_tokens=16)
    llm.generate([system + prompt_of(3, 41)], greedy(2 * W))
    prompt = system + prompt_of(5, 42)
    naive = llm.scheduler.radix.naive_match_length(prompt[:-1])
    out = llm.generate([prompt], greedy(4))[0]
    assert len(system) <= out.num_cached_tokens == naive
    assert out.token_ids == LLM("tiny", enable_prefix_cache=False).generate([prompt], greedy(4))[0].token_ids
    check_against(ref, prompt, out)


def test_shared_prefix_whose_swa_was_evicted_is_not_reused_unsafely(ref) -> None:
    """Memory pressure evicted the SWA of the shared prefix (only the latest window is left): the token match is
    longer than the window-safe one, the request reuses only the latter, and the outputs are still exact."""
    system = prompt_of(3 * W, 43)
    llm = LLM("tiny", max_prefill_tokens=16)
    llm.generate([system + prompt_of(3, 44)], greedy(2 * W))
    radix = llm.scheduler.radix
    radix.evict(0, radix.cached_swa() - (W - 1))
    prompt = system + prompt_of(5, 45)
    safe = radix.match_length(prompt[:-1])
    assert safe < len(system) <= radix.naive_match_length(prompt[:-1])
    out = llm.generate([prompt], greedy(4))[0]
    assert out.num_cached_tokens == safe
    check_against(ref, prompt, out)


def test_same_prompt_while_the_first_still_decodes(ref) -> None:
    """A second request with the same prompt, submitted while the first decodes, reuses the first's prompt KV
    (locked by both); both equal transformers, and the pools hold only the cache afterwards."""
    prompt = prompt_of(2 * W + 5, 46)
    llm = LLM("tiny", max_prefill_tokens=8)
    first = llm.add_request(prompt, greedy(3 * W))
    while not llm.output(first).token_ids:
        llm.step()
    llm.step()
    second = llm.add_request(prompt, greedy(W))
    outs = {}
    while llm.has_unfinished():
        outs.update({o.request_id: o.output for o in llm.step() if o.finished})
        if second not in outs:
            assert first not in outs  # the first is still decoding when the second finishes
    assert outs[second].num_cached_tokens == len(prompt) - 1
    assert outs[second].token_ids == outs[first].token_ids[:W]
    for out in outs.values():
        check_against(ref, prompt, out)
    usage = llm.scheduler.usage()
    assert usage["full_used"] == usage["full_cached"] and usage["swa_used"] == usage["swa_cached"]


def test_preempted_and_resumed_requests_match(ref) -> None:
    prompts = [prompt_of(12 + 3 * i, 50 + i) for i in range(5)]
    params = greedy(16)
    tight = LLM("tiny", num_full_slots=64, num_swa_slots=40, max_prefill_tokens=16, swa_release_interval=2)
    outs = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert sum(o.num_preemptions for o in outs) > 0
    free = LLM("tiny").generate(prompts, params)
    for prompt, out, expected in zip(prompts, outs, free, strict=True):
        assert out.token_ids == expected.token_ids
        check_against(ref, prompt, out)
    usage = tight.scheduler.usage()  # nothing leaked: every used slot is the prefix cache's
    assert usage["full_used"] == usage["full_cached"] and usage["swa_used"] == usage["swa_cached"]


def test_preemption_without_prefix_cache_frees_everything(ref) -> None:
    prompts = [prompt_of(10, 60 + i) for i in range(4)]
    llm = LLM("tiny", num_full_slots=48, num_swa_slots=32, max_prefill_tokens=8, enable_prefix_cache=False,
              swa_release_interval=2)
    outs = llm.generate(prompts, greedy(12))
    assert llm.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        check_against(ref, prompt, out)
    assert llm.scheduler.usage()["full_used"] == 0 and llm.scheduler.usage()["swa_used"] == 0
