"""ScaleFL (METHODS §6): its exit heads, registered as exit_kind "scalefl"."""

from nestling.methods.scalefl.exit_head import ScaleFLExit, ScaleFLExitHead

__all__ = ["ScaleFLExit", "ScaleFLExitHead"]
