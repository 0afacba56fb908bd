"""Logging for the command lines: one handler on the root logger that writes to `sys.stderr` as it is when a
record is emitted, not as it was when logging was configured.

`logging.basicConfig` binds its handler to the stream object of that moment. Whoever swaps `sys.stderr` later
(pytest's capture, a notebook, an embedding program calling `nestling.cli.main`) leaves that handler writing
into a stream that may be closed by then, and a background thread's record (the embedded broker's) becomes a
'--- Logging error ---' traceback instead of a line.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO


class CurrentStderrHandler(logging.StreamHandler):
    """A StreamHandler whose stream is always the current `sys.stderr`."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:  # StreamHandler.__init__/setStream assign it; the property wins
        pass


def configure_logging(level: int | str, fmt: str, *, force: bool = False) -> None:
    """Root logging at `level` through one CurrentStderrHandler (`force`: replace what is there)."""
    logging.basicConfig(level=level, format=fmt, handlers=[CurrentStderrHandler()], force=force)
