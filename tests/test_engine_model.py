"""Engine model plumbing: config <-> transformers config, save_pretrained -> our loader, inputs_embeds."""

from __future__ import annotations

import json

import pytest
import torch

from engine_link.engine import LLM, MODEL_PRESETS, EngineModelConfig, Prompt, SamplingParams
from engine_link.engine.config import default_layer_types
from engine_link.engine.loader import load_model, save_model

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny shapes gain nothing from intra-op threads, and a busy 2-core box stalls them badly."""
    num = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num)

CFG = MODEL_PRESETS["tiny"]


def hf_model(state: dict[str, torch.Tensor] | None = None):
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

    hf_cfg = MiMoV2FlashConfig(**CFG.to_hf_dict())
    hf_cfg._attn_implementation = "eager"
    model = MiMoV2FlashForCausalLM(hf_cfg)
    if state is not None:
        model.load_state_dict(state, strict=True)
    return model.eval()


def test_layer_pattern_and_config_round_trip() -> None:
    from transformers import MiMoV2FlashConfig

    assert default_layer_types(12).count("full_attention") == 3  # layers 0, 5, 11
    assert CFG.full_layers == (0, 5) and CFG.mlp_types[0] == "dense" and CFG.mlp_types[1] == "sparse"
    for cfg in MODEL_PRESETS.values():
        hf = MiMoV2FlashConfig(**cfg.to_hf_dict())
        assert EngineModelConfig.from_hf_dict(hf.to_dict()) == cfg
    assert EngineModelConfig.from_hf_dict({**CFG.to_hf_dict(), "sliding_window_size": 127}).sliding_window == 128
    with pytest.raises(ValueError, match="rope_type"):
        yarn = {"full_attention": {"rope_type": "yarn"}}
        EngineModelConfig.from_hf_dict({**CFG.to_hf_dict(), "rope_parameters": yarn})
    with pytest.raises(ValueError, match="kv heads"):
        EngineModelConfig(num_attention_heads=4, num_key_value_heads=4)


def test_kv_bytes_hybrid_vs_all_full() -> None:
    mid = MODEL_PRESETS["mid"]
    ratio = mid.kv_bytes(131072) / mid.kv_bytes(131072, all_full=True)
    full_fraction = sum(mid.kv_elems_per_token(i) for i in mid.full_layers) / sum(
        mid.kv_elems_per_token(i) for i in range(mid.num_hidden_layers))
    assert abs(ratio - full_fraction) < 0.01  # at long context only the full layers grow


def test_save_pretrained_loads_into_ours(tmp_path) -> None:
    torch.manual_seed(3)
    ref = hf_model()
    with torch.no_grad():  # transformers initializes these to 0 / constants: make them matter
        for name, p in ref.named_parameters():
            if name.endswith("sinks"):
                p.normal_()
        for name, b in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(std=0.1)
    ref.save_pretrained(tmp_path)
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(CFG.vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    ours = load_model(str(tmp_path), torch.device("cpu"), torch.float32)
    assert ours.cfg == CFG.__class__.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))
    expected = ref.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    out = LLM(str(tmp_path)).generate([prompt], SamplingParams(temperature=0, max_tokens=4, return_logits=True))[0]
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1:]
    assert (out.logits - logits).abs().max().item() < 1e-4
    assert logits.argmax(-1).tolist() == out.token_ids
    assert out.text == " ".join(f"t{t}" for t in out.token_ids)  # tokenizer.json in the directory


def test_save_model_loads_into_transformers_and_back(tmp_path) -> None:
    from transformers import MiMoV2FlashForCausalLM

    ours = load_model("tiny", torch.device("cpu"), torch.float32)
    save_model(ours, tmp_path)
    again = load_model(str(tmp_path), torch.device("cpu"), torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), again.state_dict().values(), strict=True))
    ref = MiMoV2FlashForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    expected = ref.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, expected[name].to(tensor.dtype)), name


def test_loader_rejects_mismatched_weights(tmp_path) -> None:
    ref = hf_model()
    ref.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 48}))
    with pytest.raises(ValueError, match="wrong shape"):
        load_model(str(tmp_path), torch.device("cpu"), torch.float32)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 7,
                                                      "layer_types": config["layer_types"][:7],
                                                      "mlp_layer_types": config["mlp_layer_types"][:7]}))
    with pytest.raises(ValueError, match="unexpected"):
        load_model(str(tmp_path), torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="neither a preset"):
        load_model(str(tmp_path / "nope"), torch.device("cpu"), torch.float32)


def test_inputs_embeds_injection_matches_transformers() -> None:
    llm = LLM("tiny", max_prefill_tokens=6, num_swa_slots=64)
    ref = hf_model(llm.model.state_dict())
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, CFG.vocab_size, (20,), generator=gen).tolist()
    image = torch.randn(5, CFG.hidden_size, generator=gen)
    audio = torch.randn(3, CFG.hidden_size, generator=gen)
    prompt = Prompt(tokens, embeds=[(4, image), (13, audio)])  # runs straddle the 6-token chunks
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, return_logits=True))[0]
    with torch.no_grad():
        embeds = ref.model.embed_tokens(torch.tensor([tokens + out.token_ids[:-1]]))
        embeds[0, 4:9], embeds[0, 13:16] = image, audio
        logits = ref(inputs_embeds=embeds).logits[0, len(tokens) - 1:]
    assert (out.logits - logits).abs().max().item() < 1e-4
    assert logits.argmax(-1).tolist() == out.token_ids
    # the prefix cache keys embedding runs by content: other media at the same placeholders is a miss
    other = Prompt(tokens + out.token_ids + [1, 2], embeds=[(4, image + 1), (13, audio)])
    same = Prompt(tokens + out.token_ids + [1, 2], embeds=[(4, image), (13, audio)])
    assert llm.generate([other], SamplingParams(temperature=0, max_tokens=1))[0].num_cached_tokens == 4  # the text
    assert llm.generate([same], SamplingParams(temperature=0, max_tokens=1))[0].num_cached_tokens == 24


def test_pending_embeds_hold_prefill_until_they_arrive() -> None:
    llm = LLM("tiny", max_prefill_tokens=6, num_swa_slots=64)
    gen = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, CFG.vocab_size, (20,), generator=gen).tolist()
    image, audio = torch.randn(5, CFG.hidden_size, generator=gen), torch.randn(3, CFG.hidden_size, generator=gen)
    keys = ["image-sha", "audio-sha"]
    params = SamplingParams(temperature=0, max_tokens=4, return_logits=True)
    expected = LLM("tiny", enable_prefix_cache=False).generate(
        [Prompt(tokens, embeds=[(4, image), (13, audio)])], params)[0]
    with pytest.raises(ValueError, match="pending"):
        llm.generate([Prompt(tokens, embeds=[(4, 5)])], params)
    rid = llm.add_request(Prompt(tokens, embeds=[(4, 5), (13, audio)], embed_keys=keys), params)
    for _ in range(3):
        assert llm.step() == []
    assert llm.scheduler.running[0].num_computed == 4  # text up to the first missing embedding
    assert llm.has_unfinished() and not llm.has_runnable()
    with pytest.raises(ValueError, match="shape"):
        llm.add_embeds(rid, 4, image[:4])
    llm.add_embeds(rid, 4, image)
    assert llm.has_runnable()
    out = [o.output for o in llm.stream([], None) if o.finished][0]
    assert out.token_ids == expected.token_ids
    assert (out.logits - expected.logits).abs().max().item() < 1e-5
    # next turn: the media keys are known before encoding, so the cached KV covers the still-pending runs
    turn2 = Prompt(tokens + out.token_ids + [1, 2], embeds=[(4, 5), (13, 3)], embed_keys=keys)
    rid = llm.add_request(turn2, SamplingParams(temperature=0, max_tokens=2))
    outs = []
    while llm.has_unfinished():
        outs += llm.step()
    assert outs[-1].finished and outs[-1].output.num_cached_tokens == len(tokens) + len(out.token_ids) - 1


def test_mid_head_shapes_match_transformers(tmp_path) -> None:
    """The mid/real head layout: q/k 192 (64 rotary channels, padded to 200 with the sink), v 128, one group."""
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

    cfg = EngineModelConfig(vocab_size=256, hidden_size=96, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=192,
                            v_head_dim=128, sliding_window=5, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                            topk_group=1, routed_scaling_factor=1.0, initializer_range=0.05)
    hf_cfg = MiMoV2FlashConfig(**cfg.to_hf_dict())
    torch.manual_seed(5)
    ref = MiMoV2FlashForCausalLM(hf_cfg)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("sinks"):
                p.normal_()
    ref.save_pretrained(tmp_path)
    ref = MiMoV2FlashForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    prompt = torch.randint(0, 256, (13,), generator=torch.Generator().manual_seed(5)).tolist()
    out = LLM(str(tmp_path), max_prefill_tokens=4).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=9, return_logits=True))[0]
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1:]
    assert (out.logits - logits).abs().max().item() < 1e-4
    assert logits.argmax(-1).tolist() == out.token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_the_per_expert_loop(dtype) -> None:
    """The grouped-GEMM expert path (the default) against the per-expert loop (the fallback), with experts
    that get no token, one token and many, and a token whose top-k repeats no expert twice."""
    from engine_link.engine.moe import Experts

    cfg = EngineModelConfig(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2)
    experts = Experts(cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    experts = experts.to(dtype)
    x = torch.randn(11, 64, generator=gen).to(dtype)
    idx = torch.tensor([[0, 1]] * 6 + [[1, 2], [2, 5], [5, 0], [0, 2], [7, 1]])  # experts 3, 4, 6 idle
    weights = torch.rand(11, 2, generator=gen)
    grouped = experts(x, idx, weights)
    assert experts.grouped == {("cpu", dtype): True}, "this torch has torch._grouped_mm on CPU: it must run"
    loop = experts._loop(x, idx, weights)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grouped.float(), loop.float(), rtol=tol, atol=tol)


def test_sink_row_stays_zero_and_qkv_stay_fused(tmp_path) -> None:
    """The SWA pools' last row is the attention sink's key and value (attention.py NOTE): no slot maps to it,
    so after generating far past the window it is still zero. q/k/v_proj are views of one fused weight, and a
    saved model reloads equal."""
    llm = LLM("tiny", num_full_slots=256, enable_prefix_cache=False)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm.generate([list(range(3, 40)), list(range(50, 61))], params)
    for layer in CFG.swa_layers:
        k, v = llm.kv.layers[layer]
        assert k[llm.kv.sink_slot].abs().sum() == 0 and v[llm.kv.sink_slot].abs().sum() == 0
        assert k[: llm.kv.sink_slot].abs().sum() > 0  # the real slots were written
    attn = llm.model.model.layers[1].self_attn
    fused, _ = attn._fused
    assert attn.q_proj.weight.data_ptr() == fused.data_ptr()
    assert attn.v_proj.weight.data_ptr() == fused[-attn.v_proj.weight.shape[0]:].data_ptr()
    save_model(llm.model, tmp_path)
    again = load_model(str(tmp_path), torch.device("cpu"), torch.float32)
    for name, tensor in llm.model.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], tensor, rtol=0, atol=0)
