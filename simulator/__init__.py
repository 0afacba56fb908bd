"""Trace-replay simulation of a fleet on a workstation."""
