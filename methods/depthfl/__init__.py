"""DepthFL (METHODS §7.3): its attention-gated exit heads, registered as exit_kind "depthfl"."""

from nestling.methods.depthfl.exit_head import DepthFLExit, DepthFLExitHead, SepConv

__all__ = ["DepthFLExit", "DepthFLExitHead", "SepConv"]
