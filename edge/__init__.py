"""Edge side: local training procedures, the board agent, its resource monitor and service unit."""

import nestling.methods  # noqa: F401  (every method's exit heads are registered before a model is built)
