"""Refusal logging that helps instead of flooding: one line per device per round, then a summary.

A broken or hostile board can send the same bad frame hundreds of times a round; the operator needs
to see that it happened and why, once, plus how often.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict


class RefusalLog:
    """First refusal of each device in a round is logged in full; the rest are counted and summarised."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.round: int | None = None
        self.suppressed: dict[str, Counter[str]] = defaultdict(Counter)
        self.logged: set[str] = set()

    def refuse(self, round_index: int, device_id: str, reason: str, detail: str) -> None:
        if round_index != self.round:
            self.flush()
            self.round = round_index
        if device_id in self.logged:
            self.suppressed[device_id][reason] += 1
            return
        self.logged.add(device_id)
        self.logger.warning("round %d: refused result of %s (%s): %s", round_index, device_id, reason, detail)

    def flush(self) -> None:
        """Summary lines for the round that just ended (one per device that kept being refused)."""
        for device_id, reasons in sorted(self.suppressed.items()):
            listed = ", ".join(f"{reason} x{count}" for reason, count in sorted(reasons.items()))
            self.logger.warning(
                "round %s: %s was refused %d more times (%s)",
                self.round,
                device_id,
                sum(reasons.values()),
                listed,
            )
        self.suppressed.clear()
        self.logged.clear()
