"""FeDepth (METHODS §3): its auxiliary exit heads, registered as exit_kind "fedepth"."""

from nestling.methods.fedepth.exit_head import FeDepthExitHead

__all__ = ["FeDepthExitHead"]
