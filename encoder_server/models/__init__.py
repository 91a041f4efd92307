"""Encoder models (vision ViT)."""
