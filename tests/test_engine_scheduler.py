"""Engine scheduling on the tiny model: SWA usage stays flat, streaming, abort, stop conditions, policies,
continuous batching, sampling, and clear errors for bad input."""

from __future__ import annotations

import pytest
import torch

from engine_link.engine import LLM, MODEL_PRESETS, Prompt, SamplingParams

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny shapes gain nothing from intra-op threads, and a busy 2-core box stalls them badly."""
    num = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num)

CFG = MODEL_PRESETS["tiny"]
W = CFG.sliding_window


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", max_prefill_tokens=16, num_swa_slots=96)


def test_swa_usage_stays_flat_while_the_sequence_grows() -> None:
    interval = 4
    llm = LLM("tiny", max_prefill_tokens=8, swa_release_interval=interval, enable_prefix_cache=False)
    llm.add_request(prompt_of(30, 1), greedy(40))
    swa, full = [], []
    while llm.has_unfinished():
        llm.step()
        swa.append(llm.scheduler.swa_pool.num_used())
        full.append(llm.scheduler.full_pool.num_used())
    # prefill: at most W-1 kept + one chunk; decode: W-1 kept + up to `interval` new before each release
    assert max(swa) <= W - 1 + 8
    assert max(swa[4:-1]) <= W - 1 + interval
    assert full[-2] == 30 + 40 - 2 and full[-1] == 0  # the full pool grows with the sequence, then is freed
    assert swa[-1] == 0


def test_swa_pinned_per_request_stays_flat_with_the_prefix_cache() -> None:
    """With the prefix cache the tree keeps the prompt's SWA, but only a lock's window is pinned (not evictable):
    W-1 while prefilling; during decode the request's own window plus, for its first W-1 + interval steps,
    the prompt's last window (until the lock lets go of its SWA)."""
    interval, prompt_len = 4, 30
    llm = LLM("tiny", max_prefill_tokens=8, swa_release_interval=interval)
    llm.add_request(prompt_of(prompt_len, 1), greedy(40))
    s, pinned = llm.scheduler, []
    while llm.has_unfinished():
        llm.step()
        pinned.append(s.swa_pool.num_used() - s.radix.evictable_swa())
    num_prefill = -(-prompt_len // 8)
    assert max(pinned[:num_prefill]) == W - 1
    assert max(pinned) <= 2 * (W - 1) + interval
    assert max(pinned[num_prefill + W - 1 + interval:]) <= W - 1 + interval
    assert pinned[-1] == 0 and s.radix.cached_swa() >= prompt_len  # the prompt's SWA stays cached (evictable)


def test_repeated_prompt_keeps_its_window_under_swa_pressure() -> None:
    """A small SWA pool cannot keep a whole prompt's SWA: what goes first is the SWA inside the prompt, not the
    window a repeat of it needs, so the same prompt after another request still reuses all but its last token."""
    llm = LLM("tiny", max_prefill_tokens=8, num_swa_slots=32)
    prompt, params = prompt_of(3 * W + 3, 73), greedy(W, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    llm.generate([prompt_of(2 * W, 74)], params)
    radix = llm.scheduler.radix
    assert radix.match_length(prompt[:2 * W]) < 2 * W  # the inside of the prompt lost its SWA
    second = llm.generate([prompt], params)[0]
    assert second.num_cached_tokens == len(prompt) - 1 and second.token_ids == first.token_ids


def _image_prompt(key: str, seed: int) -> Prompt:
    """Text, an image run of 2W embedding rows at position 4, text."""
    ids = prompt_of(4, 70) + [0] * (2 * W) + prompt_of(5, 71)
    image = torch.randn(2 * W, CFG.hidden_size, generator=torch.Generator().manual_seed(seed))  # [2W, hidden]
    return Prompt(ids, embeds=[(4, image)], embed_keys=[key])


def test_same_image_prompt_twice_reuses_the_image_run_and_another_image_does_not() -> None:
    llm = LLM("tiny", max_prefill_tokens=8)
    plain = LLM(llm.model, max_prefill_tokens=8, enable_prefix_cache=False)
    params = greedy(6, return_logits=True)
    prompt, other = _image_prompt("cat.png", 0), _image_prompt("dog.png", 1)
    first, second, third = (llm.generate([p], params)[0] for p in (prompt, prompt, other))
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == len(prompt.token_ids) - 1  # across the image run
    assert third.num_cached_tokens == 4  # the text before the run; nothing of another image
    for out, p in ((first, prompt), (second, prompt), (third, other)):
        expected = plain.generate([p], params)[0]
        assert out.token_ids == expected.token_ids
        assert torch.allclose(out.logits, expected.logits, atol=1e-4)


def test_abort_of_a_request_whose_prompt_another_shares() -> None:
    """The second request runs on the first's cached prompt; aborting the first leaves it intact, and every slot
    is the cache's afterwards (all evictable: the pools drain to empty)."""
    prompt = prompt_of(2 * W + 3, 72)
    llm = LLM("tiny", max_prefill_tokens=8)
    first = llm.add_request(prompt, greedy(4 * W))
    while not llm.output(first).token_ids:
        llm.step()
    second = llm.add_request(prompt, greedy(2 * W))
    llm.step()
    llm.step()
    assert llm.abort(first)
    outs = {}
    while llm.has_unfinished():
        outs.update({o.request_id: o.output for o in llm.step() if o.finished})
    assert outs[first].finish_reason == "abort" and outs[second].num_cached_tokens == len(prompt) - 1
    expected = LLM(llm.model, enable_prefix_cache=False).generate([prompt], greedy(2 * W))[0].token_ids
    assert outs[second].token_ids == expected
    assert outs[first].token_ids == expected[:len(outs[first].token_ids)]
    s = llm.scheduler
    assert s.radix.evictable_full() == s.full_pool.num_used() == s.radix.cached_full()
    assert s.radix.evictable_swa() == s.swa_pool.num_used() == s.radix.cached_swa()
    s.radix.evict(10**6, 10**6)
    assert s.full_pool.num_used() == s.swa_pool.num_used() == 0


def test_stream_yields_the_same_tokens_as_generate(llm) -> None:
    prompts = [prompt_of(5, 2), prompt_of(20, 3)]
    expected = [o.token_ids for o in llm.generate(prompts, greedy(7))]
    got: dict[str, list[int]] = {}
    order: list[str] = []
    finished = set()
    for out in llm.stream(prompts, greedy(7)):
        if out.request_id not in got:
            order.append(out.request_id)
        got.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert out.request_id not in finished
        if out.finished:
            finished.add(out.request_id)
    assert sorted(got.values()) == sorted(expected) and len(finished) == 2


def test_decodes_and_a_new_prefill_share_a_step(llm) -> None:
    a = llm.add_request(prompt_of(6, 4), greedy(20))
    llm.step()
    llm.step()
    b = llm.add_request(prompt_of(9, 5), greedy(3))
    assert {o.request_id for o in llm.step()} == {a, b}  # a decodes while b prefills (and samples)
    finished = {}
    while llm.has_unfinished():
        finished.update({o.request_id: o.output for o in llm.step() if o.finished})
    assert len(finished[a].token_ids) == 20 and len(finished[b].token_ids) == 3


def test_abort_running_and_waiting_requests() -> None:
    llm = LLM("tiny", max_num_seqs=1, max_prefill_tokens=16, num_swa_slots=96)
    running = llm.add_request(prompt_of(7, 6), greedy(50))
    waiting = llm.add_request(prompt_of(7, 7), greedy(50))
    other = llm.add_request(prompt_of(8, 8), greedy(4))
    for _ in range(3):
        llm.step()
    assert llm.abort(running) and llm.abort(waiting)
    assert not llm.abort(running) and not llm.abort("no-such-request")
    finished = {}
    while llm.has_unfinished():
        finished.update({o.request_id: o.output for o in llm.step() if o.finished})
    assert finished[running].finish_reason == "abort" and len(finished[running].token_ids) == 3
    assert finished[waiting].finish_reason == "abort" and finished[waiting].token_ids == []
    assert len(finished[other].token_ids) == 4 and finished[other].finish_reason == "length"
    usage = llm.scheduler.usage()
    assert usage["full_used"] == usage["full_cached"] and usage["swa_used"] == usage["swa_cached"]


def test_stop_token_ends_the_request(llm) -> None:
    prompt = prompt_of(10, 9)
    free = llm.generate([prompt], greedy(8))[0].token_ids
    stop = free[3]
    out = llm.generate([prompt], greedy(8, stop_token_ids=[stop]))[0]
    assert out.token_ids == free[:free.index(stop) + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize("policy", ["fewest-uncached", "fcfs"])
def test_waiting_order_policy(policy: str) -> None:
    llm = LLM("tiny", max_num_seqs=1, policy=policy, penalty_tokens_per_s=0.0, enable_prefix_cache=False)
    long = llm.add_request(prompt_of(60, 10), greedy(2))
    short = llm.add_request(prompt_of(4, 11), greedy(2))
    first = llm.step()[0].request_id
    assert first == (short if policy == "fewest-uncached" else long)
    while llm.has_unfinished():
        llm.step()


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(llm) -> None:
    prompt = prompt_of(8, 12)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=10, seed=123)
    alone = llm.generate([prompt], params)[0].token_ids
    batched = llm.generate([prompt_of(13, 13), prompt], [greedy(4), params])[1].token_ids
    assert alone == batched
    assert llm.generate([prompt], SamplingParams(temperature=1.0, top_k=1, max_tokens=6))[0].token_ids == \
        llm.generate([prompt], greedy(6))[0].token_ids


def test_bad_inputs_raise_clear_errors(llm) -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        llm.add_request([], greedy(2))
    with pytest.raises(ValueError, match="list of prompts"):
        llm.generate([1, 2, 3], greedy(2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.add_request([1, CFG.vocab_size], greedy(2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.add_request([-1], greedy(2))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="exceeds the KV capacity"):
        llm.add_request([1] * (llm.config.num_full_slots - 3), greedy(4))
    with pytest.raises(ValueError, match="shape"):
        llm.add_request(Prompt([1, 2, 3], embeds=[(0, torch.zeros(2, CFG.hidden_size + 1))]), greedy(2))
    with pytest.raises(ValueError, match="overlaps"):
        llm.add_request(Prompt([1, 2, 3], embeds=[(2, torch.zeros(2, CFG.hidden_size))]), greedy(2))
    with pytest.raises(ValueError, match="unknown engine options"):
        LLM("tiny", num_full_slot=3)
    with pytest.raises(ValueError, match="num_swa_slots"):
        LLM("tiny", num_swa_slots=16, max_prefill_tokens=64)
    with pytest.raises(ValueError, match="neither a preset"):
        LLM("no-such-model")
    assert not llm.has_unfinished()  # nothing half-added
