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
    """A message on the wire is malformed, corrupt, oversized or does not match its task."""


class DependencyError(NestlingError):
    """An optional dependency (tensorrt, ray, flwr, ...) needed for this path is not installed."""
