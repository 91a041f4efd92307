"""Embedding cache and routing (content keys, shared-memory cache, consistent-hash ring)."""
