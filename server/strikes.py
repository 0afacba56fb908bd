"""Boards the cohort screen keeps refusing are set aside for a while, longer each time.

The cohort update screen (server/update_cohort.py) refuses one update at a time, and only in rounds whose boards
agree. A board that trains on flipped labels is refused in most of its rounds but not all: in its first rounds
its update still points downhill with everyone else's, and late in a run, when honest updates spread out, the
cut can fall just under it. Each round it slips through costs the fleet (issue 25: one such board among ten took
FedAvg on digits 3.7 points down over 20 rounds, 12.8 on one seed). Its record, though, is plain: refused in
round after round where honest boards never are (the honest runs of every method and partition are refused
nothing, tests/simulator/test_robust_runs.py).

So a board refused by the cohort screen in STRIKES of its last WINDOW judged rounds (rounds where its cohort
had a consensus to judge it by) is not selected for `rounds` rounds, doubled each time it happens again; its
record starts over when it returns, and it is on probation until WINDOW judged rounds in a row find nothing
against it: the cohort screen refuses its updates at half the distance from the cohort's median
(server/update_cohort.py, PROBATION_SPREADS), and in rounds it cannot judge them (no consensus, or too few
updates of its submodel) does not take them at all. An honest board would need two refusals in three judged
rounds; over the 1,330 honest IID board-rounds recorded for issue 25 (seeds 0-6, honest and label-flip runs)
the screen refused none.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

WINDOW = 3  # judged rounds a board's record looks back on
STRIKES = 2  # refusals within them that set it aside


@dataclass
class StrikeRecord:
    """Each board's last WINDOW judged rounds (True: refused) and how often it was set aside."""

    rounds: int  # first time aside, in rounds (0: never set aside)
    history: dict[str, deque[bool]] = field(default_factory=dict)
    times: Counter[str] = field(default_factory=Counter)
    # device on probation -> judged rounds in a row it has passed since it came back
    probation: dict[str, int] = field(default_factory=dict)

    def on_probation(self, device: str) -> bool:
        """Set aside before and not yet cleared: the cohort screen holds it to a closer cut."""
        return device in self.probation

    def judge(self, round_index: int, judged: Iterable[str], refused: set[str]) -> dict[str, int]:
        """Note one round's verdicts; the boards set aside now, each with the first round it may train again."""
        aside: dict[str, int] = {}
        for device in sorted(set(judged)):
            record = self.history.setdefault(device, deque(maxlen=WINDOW))
            record.append(device in refused)
            if device in self.probation:
                passed = 0 if device in refused else self.probation[device] + 1
                self.probation[device] = passed
                if passed >= WINDOW:
                    del self.probation[device]
            if self.rounds > 0 and sum(record) >= STRIKES:
                self.times[device] += 1
                aside[device] = round_index + 1 + self.rounds * 2 ** (self.times[device] - 1)
                self.probation[device] = 0
                record.clear()
        return aside
