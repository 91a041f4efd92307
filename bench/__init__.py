"""Benchmarks: `mmenc bench vit|preprocess`."""
