"""Bundled prefill/decode engine: MiMo-V2-Flash (hybrid SWA + MoE) over dual KV pools with an SWA-aware
prefix cache, chunked prefill and continuous batching."""
