"""Procedures register themselves with their capabilities; the batched trainer reads them, not a list of names."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from nestling.edge.procedures import (
    LocalOutcome,
    get_procedure,
    is_batchable,
    known_procedures,
    register_procedure,
    restore_procedures,
    snapshot_procedures,
    unregister_procedure,
)
from nestling.errors import ConfigError
from nestling.messages import Task
from nestling.simulator.batched import batch_key


@pytest.fixture
def registry() -> Iterator[None]:
    """The procedure registry as it was before the test, restored after it (and checked)."""
    saved = snapshot_procedures()
    yield
    restore_procedures(saved)
    assert snapshot_procedures() == saved


def _task(procedure: str) -> Task:
    return Task(
        round=0, device_id="d", spec={"id": "s"}, weights={}, procedure=procedure, hparams={"lr": 0.1}
    )


def test_only_procedures_declared_batchable_are_grouped() -> None:
    assert is_batchable("sgd")
    assert "dynamicfl" in known_procedures()
    assert not is_batchable("dynamicfl")  # it changes the network's structure per board
    assert batch_key(_task("dynamicfl"), 24) is None


def test_a_procedure_defined_outside_the_package_registers_in_one_line(registry: None) -> None:
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


def test_every_module_of_the_package_is_discovered_without_a_list() -> None:
    """edge/procedures/__init__.py imports its modules (nestling.discovery): each registers its own procedures."""
    import sys

    import nestling.edge.procedures as package

    modules = sorted(p.stem for p in Path(package.__file__).parent.glob("*.py") if p.stem != "__init__")
    assert all(f"nestling.edge.procedures.{name}" in sys.modules for name in modules)
    assert {"sgd", "fjord", "depthfl-kd", "scalefl-sd", "fedepth", "dynamicfl"} <= set(known_procedures())


def test_a_procedure_must_name_a_typed_record_for_its_hyper_parameters(registry: None) -> None:
    with pytest.raises(ConfigError, match="params must be a TrainParams record"):
        register_procedure("test-untyped", params=dict)  # type: ignore[arg-type]
    assert "test-untyped" not in known_procedures()


def test_restoring_a_snapshot_brings_back_a_replaced_procedure_and_drops_added_ones() -> None:
    saved = snapshot_procedures()
    sgd = get_procedure("sgd")
    unregister_procedure("sgd")
    register_procedure("test-added")(lambda *args: None)  # type: ignore[arg-type,return-value]
    restore_procedures(saved)
    assert get_procedure("sgd") is sgd and is_batchable("sgd") and "test-added" not in known_procedures()
