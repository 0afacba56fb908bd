"""Nestling: federated learning across unequal edge boards (shared kernel)."""

__version__ = "0.1.0"
