"""Reproducible side-by-side measurements; run each as `python -m benchmarks.NAME` from the repo root."""
