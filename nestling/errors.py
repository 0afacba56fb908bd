"""Error types users can act on: each names what was wrong, never a bare traceback."""


class NestlingError(Exception):
    """Base of every error Nestling raises on purpose; the CLI prints it as one line."""


class ConfigError(NestlingError):
    """A config file or command-line value is malformed, unknown or out of range."""


class SpecError(NestlingError):
    """A SubmodelSpec is impossible for its architecture (width 0, no blocks kept, ...)."""


class DataError(NestlingError):
    """A dataset is missing, unreadable or inconsistent."""


class WireError(NestlingError):
    """A message on the wire is malformed, corrupt, oversized or does not match its task.

    `reason` is the counter name a server files it under (malformed, oversized, sha_mismatch,
    unknown_schema, non_finite), so admission never has to parse the message text."""

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason


class DependencyError(NestlingError):
    """An optional dependency (tensorrt, ray, flwr, ...) needed for this path is not installed."""
