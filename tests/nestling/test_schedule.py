"""Learning-rate schedules decay on the round index (METHODS §2.a.6.8: ×0.1 at T/2 and 3T/4)."""

from __future__ import annotations

import math

import pytest

from nestling.errors import ConfigError
from nestling.schedule import LrSchedule


def test_step_schedule_decays_at_half_and_three_quarters_of_the_rounds() -> None:
    schedule = LrSchedule("step", lr=0.1, gamma=0.1, milestones=(0.5, 0.75))
    lrs = [schedule.at(t, 100) for t in (0, 49, 50, 74, 75, 99)]
    assert lrs == pytest.approx([0.1, 0.1, 0.01, 0.01, 0.001, 0.001])


def test_constant_cosine_and_exponential_schedules() -> None:
    assert LrSchedule("constant", lr=0.3).at(77, 100) == 0.3
    cosine = LrSchedule("cosine", lr=0.1, min_lr=0.0)
    assert cosine.at(0, 10) == pytest.approx(0.1) and cosine.at(5, 10) == pytest.approx(0.05)
    assert cosine.at(10, 10) == pytest.approx(0.0, abs=1e-12)
    depthfl = LrSchedule("exponential", lr=0.1, gamma=0.998)
    assert depthfl.at(3, 1000) == pytest.approx(0.1 * 0.998**3)
    assert math.isclose(depthfl.at(0, 1000), 0.1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "sawtooth"}, "unknown lr schedule 'sawtooth'"),
        ({"lr": 0.0}, "lr must be > 0"),
    ],
)
def test_bad_schedules_are_config_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LrSchedule(**kwargs)
