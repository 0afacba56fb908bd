"""Trace-replay simulation of a fleet on a workstation."""

import nestling.methods  # noqa: F401  (every method's exit heads are registered before a model is built)
