"""Coordinator, strategies, transports and broker helpers."""

import nestling.methods  # noqa: F401  (every method's exit heads are registered before a model is built)
