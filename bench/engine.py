"""`mmenc bench engine`: the bundled MiMo-V2-Flash engine, KV footprint and throughput, vs transformers.

1. KV bytes per token of one request at 4K/32K/128K context: the hybrid layout (full layers O(context),
   SWA layers O(window)) vs the same model with every layer full attention. Computed from the config and
   checked against the engine's real pool tensors (bytes per slot of each pool).
2. Prefill and decode tokens/s at batch 1..64 (greedy, random prompts, prefix cache off): ours vs
   transformers `generate` on the same weights, same run. Prefill time = a run with max_tokens=1; decode
   tokens/s = B * (D - 1) / (time of a D-token run - prefill time). The baseline is skipped with a message
   when this transformers has no MiMoV2FlashForCausalLM.
3. Waiting-queue policy: a shuffled burst of short and long requests queued at once, TTFT p50/p90 per kind
   under "fewest-uncached" (shortest real prefill first) and "fcfs", same weights.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from bench.common import environment, markdown_table, sync, write_results
from engine_link.engine import LLM, EngineModelConfig, SamplingParams
from engine_link.engine.kv_cache import KVCache


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def kv_rows(cfg: EngineModelConfig, contexts: list[int], dtype: torch.dtype) -> list[dict[str, Any]]:
    """KV bytes per token of one request, hybrid vs all-full; formula checked against real pool tensors."""
    pools = KVCache(cfg, 1, 1, torch.device("meta"), dtype)
    per_full_slot, per_swa_slot = pools.bytes_per_slot(swa=False), pools.bytes_per_slot(swa=True)
    elem = torch.empty(0, dtype=dtype).element_size()
    rows = []
    for context in contexts:
        hybrid = per_full_slot * context + per_swa_slot * min(context, cfg.sliding_window)
        assert hybrid == cfg.kv_bytes(context, elem), "pool tensors disagree with the config's KV formula"
        all_full = cfg.kv_bytes(context, elem, all_full=True)
        rows.append({"context": context, "hybrid_B_per_tok": hybrid / context, "all_full_B_per_tok": all_full / context,
                     "ratio": hybrid / all_full, "hybrid_GiB": hybrid / 2**30, "all_full_GiB": all_full / 2**30})
    return rows


def _reference(llm: LLM) -> torch.nn.Module | None:
    try:
        from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM
    except ImportError:
        import transformers

        print(f"transformers {transformers.__version__} has no MiMoV2FlashForCausalLM: skipping the baseline")
        return None
    hf_cfg = MiMoV2FlashConfig(**llm.model_config.to_hf_dict())
    hf_cfg._attn_implementation = "eager"  # transformers supports neither sdpa nor flex for this model
    with torch.device(llm.device):
        ref = MiMoV2FlashForCausalLM(hf_cfg)
    ref.load_state_dict(llm.model.state_dict(), strict=True)
    return ref.to(llm.dtype).eval()


def _timed(fn, device: torch.device, iters: int) -> float:
    """Best-of-`iters` seconds of `fn` after one warm-up call (long runs: min is the least noisy)."""
    fn()
    best = float("inf")
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def throughput_rows(llm: LLM, ref: torch.nn.Module | None, batches: list[int], prompt_len: int, decode_len: int,
                    iters: int, ref_max_batch: int) -> list[dict[str, Any]]:
    cfg, device = llm.model_config, llm.device
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in batches:
        prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=gen)
        lists = prompts.tolist()
        first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        full = SamplingParams(temperature=0, max_tokens=decode_len, ignore_eos=True)
        t_prefill = _timed(lambda: llm.generate(lists, first), device, iters)  # noqa: B023
        t_total = _timed(lambda: llm.generate(lists, full), device, iters)  # noqa: B023
        row: dict[str, Any] = {"batch": batch, "prompt": prompt_len, "decode": decode_len,
                               "prefill_tok_s": batch * prompt_len / t_prefill,
                               "decode_tok_s": batch * (decode_len - 1) / max(t_total - t_prefill, 1e-9)}
        if ref is not None and batch <= ref_max_batch:
            ids = prompts.to(device)

            def hf(n: int, ids: torch.Tensor = ids) -> torch.Tensor:
                with torch.inference_mode():
                    return ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                        min_new_tokens=n, do_sample=False, pad_token_id=0)

            r_prefill = _timed(lambda: hf(1), device, iters)
            r_total = _timed(lambda: hf(decode_len), device, iters)
            ours = [o.token_ids for o in llm.generate(lists, full)]
            theirs = hf(decode_len)[:, prompt_len:].tolist()
            row.update(ref_prefill_tok_s=batch * prompt_len / r_prefill,
                       ref_decode_tok_s=batch * (decode_len - 1) / max(r_total - r_prefill, 1e-9),
                       same_tokens=sum(a == b for a, b in zip(ours, theirs, strict=True)) / batch)
            row["prefill_speedup"] = row["prefill_tok_s"] / row["ref_prefill_tok_s"]
            row["decode_speedup"] = row["decode_tok_s"] / row["ref_decode_tok_s"]
        rows.append(row)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return rows


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def policy_rows(llm: LLM, num_short: int, num_long: int, short_len: int, long_len: int, max_num_seqs: int,
                max_prefill_tokens: int) -> list[dict[str, Any]]:
    """TTFT of a burst of short and long requests (shuffled, all queued at once) under each waiting policy."""
    cfg = llm.model_config
    gen = torch.Generator().manual_seed(1)
    lengths = [short_len] * num_short + [long_len] * num_long
    order = torch.randperm(len(lengths), generator=gen).tolist()
    prompts = [torch.randint(0, cfg.vocab_size, (lengths[i],), generator=gen).tolist() for i in order]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    rows = []
    for policy in ("fewest-uncached", "fcfs"):
        engine = LLM(llm.model, policy=policy, enable_prefix_cache=False, max_num_seqs=max_num_seqs,
                     max_prefill_tokens=max_prefill_tokens, num_full_slots=max_num_seqs * (long_len + 8) + 16)
        engine.generate(prompts[:2], params)  # warm-up
        sync(llm.device)
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        makespan = time.perf_counter() - start
        ttft = {"short": [], "long": []}
        for prompt, out in zip(prompts, outs, strict=True):
            ttft["short" if len(prompt) == short_len else "long"].append(out.ttft_s)
        row: dict[str, Any] = {"policy": policy, "requests": len(prompts), "makespan_s": makespan}
        for kind, values in ttft.items():
            row[f"{kind}_ttft_p50_s"] = _percentile(values, 0.5)
            row[f"{kind}_ttft_p90_s"] = _percentile(values, 0.9)
        rows.append(row)
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        del engine
    return rows


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="mmenc bench engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mid" if cuda else "tiny", help="preset (tiny, mid) or a model directory")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--contexts", default="4096,32768,131072", help="contexts for the KV bytes table")
    p.add_argument("--batches", default="1,4,16,64" if cuda else "1,4,16")
    p.add_argument("--prompt-len", type=int, default=512 if cuda else 64)
    p.add_argument("--decode-len", type=int, default=64 if cuda else 16)
    p.add_argument("--max-prefill-tokens", type=int, default=8192 if cuda else 512)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--ref-max-batch", type=int, default=64, help="largest batch also run on transformers")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--policy-requests", default="48,16" if cuda else "24,8",
                   help="short,long requests of the waiting-policy burst (0,0: skip)")
    p.add_argument("--policy-lens", default="256,8192" if cuda else "16,192", help="short,long prompt lengths")
    p.add_argument("--policy-max-seqs", type=int, default=16 if cuda else 4)
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--name", default="engine")
    a = p.parse_args(argv)

    batches = _ints(a.batches)
    max_batch = max(batches)
    seq_len = a.prompt_len + a.decode_len
    torch.manual_seed(0)
    start = time.perf_counter()
    llm = LLM(a.model, device=a.device, dtype=a.dtype, enable_prefix_cache=False, max_num_seqs=max_batch,
              max_prefill_tokens=a.max_prefill_tokens, num_full_slots=max_batch * seq_len + 16)
    print(f"loaded {a.model} on {llm.device} ({llm.dtype}) in {time.perf_counter() - start:.1f}s", flush=True)
    cfg = llm.model_config
    kv = kv_rows(cfg, _ints(a.contexts), llm.dtype)
    print(markdown_table(kv, ["context", "hybrid_B_per_tok", "all_full_B_per_tok", "ratio", "hybrid_GiB",
                              "all_full_GiB"]))
    ref = None if a.no_reference else _reference(llm)
    rows = throughput_rows(llm, ref, batches, a.prompt_len, a.decode_len, a.iters, a.ref_max_batch)
    num_params = sum(t.numel() for t in llm.model.parameters())
    num_experts = sum(t.numel() for n, t in llm.model.named_parameters() if ".experts." in n)
    active = num_params - num_experts + num_experts * cfg.num_experts_per_tok // cfg.n_routed_experts
    for row in rows:  # 2 FLOP per active parameter per token (attention scores not counted)
        row["prefill_tflops"] = 2 * active * row["prefill_tok_s"] / 1e12
        row["decode_tflops"] = 2 * active * row["decode_tok_s"] / 1e12
    has_reference = ref is not None
    del ref  # free its memory before the policy runs
    (num_short, num_long), (short_len, long_len) = _ints(a.policy_requests), _ints(a.policy_lens)
    policy = (policy_rows(llm, num_short, num_long, short_len, long_len, a.policy_max_seqs, a.max_prefill_tokens)
              if num_short + num_long else [])
    payload = {"bench": "engine", "model": a.model, "dtype": str(llm.dtype).removeprefix("torch."),
               "params": num_params, "active_params": active, "layers": cfg.num_hidden_layers,
               "full_layers": len(cfg.full_layers), "sliding_window": cfg.sliding_window,
               "reference": has_reference, "env": environment(llm.device),
               "argv": argv if argv is not None else sys.argv[1:], "kv": kv, "rows": rows,
               "policy": policy}
    path = write_results(a.name, a.out_dir, payload)
    cols = ["batch", "prompt", "decode", "prefill_tok_s", "decode_tok_s", "prefill_tflops", "ref_prefill_tok_s",
            "ref_decode_tok_s", "prefill_speedup", "decode_speedup", "same_tokens"]
    print(markdown_table(rows, cols))
    if policy:
        print(markdown_table(policy, ["policy", "requests", "makespan_s", "short_ttft_p50_s", "short_ttft_p90_s",
                                      "long_ttft_p50_s", "long_ttft_p90_s"]))
    best = max(rows, key=lambda r: r["decode_tok_s"])
    long = kv[-1]
    print(f"SUMMARY engine {a.model} {payload['dtype']}: KV {long['hybrid_B_per_tok'] / 1024:.1f} KiB/token at "
          f"{long['context']} ({long['ratio']:.3f} of all-full); decode {best['decode_tok_s']:.0f} tok/s at batch "
          f"{best['batch']}" + (f" ({best['decode_speedup']:.1f}x transformers)" if "decode_speedup" in best else "")
          + (f"; short-request TTFT p90 {policy[0]['short_ttft_p90_s'] * 1e3:.0f} ms fewest-uncached vs "
             f"{policy[1]['short_ttft_p90_s'] * 1e3:.0f} ms fcfs" if policy else "")
          + f"; results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
