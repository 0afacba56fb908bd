"""Measured and estimated costs of submodels on boards: profiles, the estimator, the planner, device traces."""

import nestling.methods  # noqa: F401  (every method's exit heads are registered before a model is built)
