"""Procedures register themselves with their capabilities; the batched trainer reads them, not a list of names."""

from __future__ import annotations

import pytest

from nestling.edge.procedures import (
    LocalOutcome,
    get_procedure,
    is_batchable,
    known_procedures,
    register_procedure,
)
from nestling.errors import ConfigError
from nestling.messages import Task
from nestling.simulator.batched import batch_key


def _task(procedure: str) -> Task:
    return Task(
        round=0, device_id="d", spec={"id": "s"}, weights={}, procedure=procedure, hparams={"lr": 0.1}
    )


def test_only_procedures_declared_batchable_are_grouped() -> None:
    assert is_batchable("sgd")
    assert "dynamicfl" in known_procedures()
    assert not is_batchable("dynamicfl")  # it changes the network's structure per board
    assert batch_key(_task("dynamicfl"), 24) is None


def test_a_procedure_defined_outside_the_package_registers_in_one_line() -> None:
    @register_procedure("test-proximal", batchable=False)
    def proximal(model, data, hp, store, generator):  # type: ignore[no-untyped-def]
        return LocalOutcome(model, len(data), [], 0)

    assert get_procedure("test-proximal") is proximal
    assert "test-proximal" in known_procedures() and not is_batchable("test-proximal")
    register_procedure("test-proximal")(proximal)  # the same function again (a re-import) is harmless
    with pytest.raises(ConfigError, match="registered twice"):
        register_procedure("test-proximal")(lambda *args: proximal(*args))
    with pytest.raises(ConfigError, match="unknown local procedure 'nope'"):
        get_procedure("nope")
