"""Coordinator, strategies, transports and broker helpers."""
