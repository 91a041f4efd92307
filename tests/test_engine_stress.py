"""A multi-turn workload under tight pools (prefix cache, chunking, preemption all at once) gives exactly
the tokens of a roomy engine without a prefix cache, and leaks no KV slot."""

from __future__ import annotations

import pytest
import torch

from engine_link.engine import LLM, MODEL_PRESETS, SamplingParams

pytestmark = pytest.mark.timeout(120)

CFG = MODEL_PRESETS["tiny"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny shapes gain nothing from intra-op threads, and a busy 2-core box stalls them badly."""
    num = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num)


@pytest.fixture(scope="module")
def roomy() -> LLM:
    return LLM("tiny", enable_prefix_cache=False)


def assert_no_leak(llm: LLM) -> None:
    """Between generate calls every used slot belongs to the prefix cache, and all of it is evictable."""
    s = llm.scheduler
    usage = s.usage()
    assert usage["full_used"] == usage["full_cached"] and usage["swa_used"] == usage["swa_cached"]
    if s.radix is not None:
        assert s.radix.evictable_full() == usage["full_cached"]


@pytest.mark.parametrize("setting", [
    {"num_full_slots": 64, "num_swa_slots": 40, "max_prefill_tokens": 8, "swa_release_interval": 2},
    {"num_full_slots": 96, "num_swa_slots": 28, "max_prefill_tokens": 5, "max_num_seqs": 3, "policy": "fcfs"},
    {"num_full_slots": 72, "num_swa_slots": 40, "max_prefill_tokens": 8, "enable_prefix_cache": False},
])
def test_multi_turn_workload_under_tight_pools(setting: dict, roomy: LLM) -> None:
    tight = LLM("tiny", **setting)
    gen = torch.Generator().manual_seed(0)
    conversations = [torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist() for n in (12, 7, 15, 3)]
    params = [SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=0, max_tokens=3),
              SamplingParams(temperature=0.8, top_k=40, max_tokens=5, seed=7), SamplingParams(temperature=0,
                                                                                                max_tokens=8)]
    num_cached = 0
    for _ in range(3):
        got = tight.generate(conversations, params)
        expected = roomy.generate(conversations, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        num_cached += sum(o.num_cached_tokens for o in got)
        assert_no_leak(tight)
        conversations = [c + o.token_ids + torch.randint(0, CFG.vocab_size, (4,), generator=gen).tolist()
                         for c, o in zip(conversations, got, strict=True)]
    assert tight.scheduler.num_preemptions > 0
    assert (num_cached > 0) == tight.config.enable_prefix_cache


def test_random_aborts_under_pressure_leave_no_slot_behind(roomy: LLM) -> None:
    tight = LLM("tiny", num_full_slots=64, num_swa_slots=36, max_prefill_tokens=6, swa_release_interval=2)
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(0, CFG.vocab_size, (10,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, CFG.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 20, (10,), generator=gen)]
    params = SamplingParams(temperature=0, max_tokens=12)
    ids = [tight.add_request(p, params) for p in prompts]
    to_abort = {ids[i] for i in (1, 4, 7)}
    finished, step = {}, 0
    while tight.has_unfinished():
        step += 1
        if step in (2, 5, 9):
            tight.abort(sorted(to_abort)[(2, 5, 9).index(step)])
        finished.update({o.request_id: o.output for o in tight.step() if o.finished})
        usage = tight.scheduler.usage()
        assert usage["full_used"] <= tight.config.num_full_slots and usage["swa_used"] <= 36
    assert set(finished) == set(ids)
    expected = roomy.generate(prompts, params)
    for rid, exp in zip(ids, expected, strict=True):
        if rid in to_abort:
            assert finished[rid].finish_reason == "abort"
            assert finished[rid].token_ids == exp.token_ids[:len(finished[rid].token_ids)]
        else:
            assert finished[rid].token_ids == exp.token_ids
    assert_no_leak(tight)
    tight.scheduler.radix.evict(10**6, 10**6)  # everything cached is evictable: the pools drain to empty
    assert tight.scheduler.usage()["full_used"] == 0 and tight.scheduler.usage()["swa_used"] == 0


def test_repeated_and_shared_prompts_arriving_while_others_run(roomy: LLM) -> None:
    """Identical prompts, and prompts that share a system prompt longer than the window, arrive two steps apart,
    so each meets the others' prompts in the tree mid-prefill or mid-decode; tight pools preempt, one request is
    aborted. Every output equals a roomy engine's, the cache is hit, and the pools drain to empty."""
    tight = LLM("tiny", num_full_slots=64, num_swa_slots=32, max_prefill_tokens=5, swa_release_interval=2,
                max_num_seqs=3)
    gen = torch.Generator().manual_seed(2)
    window = CFG.sliding_window
    system = torch.randint(0, CFG.vocab_size, (2 * window,), generator=gen).tolist()
    base = [system + torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist() for n in (3, 6)]
    params = SamplingParams(temperature=0, max_tokens=10)
    ids, finished, step = [], {}, 0
    while len(ids) < 8 or tight.has_unfinished():
        if step % 2 == 0 and len(ids) < 8:
            ids.append(tight.add_request(base[len(ids) % 2], params))
        if step == 7:
            assert tight.abort(ids[1])
        finished.update({o.request_id: o.output for o in tight.step() if o.finished})
        step += 1
    expected = [o.token_ids for o in roomy.generate(base, params)]
    for i, rid in enumerate(ids):
        out = finished[rid]
        assert out.token_ids == expected[i % 2][:len(out.token_ids)]
        assert (len(out.token_ids) < 10) == (i == 1)
    assert finished[ids[1]].num_cached_tokens > 0  # it arrived while the first was still prefilling the system
    assert tight.scheduler.num_preemptions > 0 and tight.scheduler.num_cached_tokens >= 6 * len(system)
    assert_no_leak(tight)
    tight.scheduler.radix.evict(10**6, 10**6)
    assert tight.scheduler.usage()["full_used"] == 0 and tight.scheduler.usage()["swa_used"] == 0
