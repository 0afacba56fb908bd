"""Methods declare what they are on their class; the README, `nestling plan` and the CLI read the declarations."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nestling.cli import simulate_parser
from nestling.edge.procedures import known_procedures
from nestling.server.plan_methods import plannable_methods
from nestling.server.strategies import STRATEGIES
from nestling.server.strategies.planning import Plannable

README = Path(__file__).resolve().parents[3] / "README.md"


def _readme_rows() -> dict[str, tuple[str, str]]:
    """README methods table: method name -> (procedure, plan) as written."""
    text = README.read_text()
    table = text[text.index("| name | method | board procedure |") :].split("\n\n")[0]
    rows: dict[str, tuple[str, str]] = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        for name in re.findall(r"`([^`]+)`", cells[0]):
            rows[name] = (cells[2].strip("`"), cells[3])
    return rows


def _plan_word(cls: type) -> str:
    """How a method plans as the README says it: its `planning` word when it is Plannable, else a dash."""
    return cls.planning if issubclass(cls, Plannable) else "—"


def test_every_registered_method_declares_a_known_procedure_and_plan_kind() -> None:
    for name, cls in STRATEGIES.items():
        assert cls.name == name
        assert cls.procedure in known_procedures(), name
        assert _plan_word(cls) in ("family", "levels", "depthwise", "—"), name


def test_the_readme_table_is_the_registry() -> None:
    rows = _readme_rows()
    assert set(rows) == set(STRATEGIES)
    for name, (procedure, plan) in rows.items():
        assert procedure == STRATEGIES[name].procedure, name
        assert plan == _plan_word(STRATEGIES[name]), name


def test_plan_and_the_cli_list_what_the_classes_declare() -> None:
    assert plannable_methods() == {n: c.planning for n, c in STRATEGIES.items() if issubclass(c, Plannable)}
    help_text = simulate_parser().format_help()
    assert all(name in help_text for name in STRATEGIES)


RUN_SHAPES = {
    # what users run: options that add hyper-parameters (masked CE with label sets, FjORD's KD, m-FeDepth's
    # auxiliaries, DynamicFL's inner width), and a run config with every optional training key set.
    "heterofl": ("resnet20", {"masked_ce": True}),
    "fjord": ("resnet20", {"kd": True}),
    "fedepth": ("preresnet20", {}),
    "m-fedepth": ("preresnet20", {"budgets": "surplus"}),
    "dynamicfl": ("resnet20", {"inner_width": 8}),
}


@pytest.mark.parametrize("method", sorted(STRATEGIES))
def test_every_methods_tasks_fit_its_procedures_typed_record(method: str) -> None:
    from nestling.edge.procedures import check_hparams
    from nestling.server.strategies import DeviceInfo, StrategyContext, create_strategy

    arch, options = RUN_SHAPES.get(method, ("resnet20", {}))
    ctx = StrategyContext(
        arch=arch,
        num_classes=10,
        in_channels=3,
        image_size=32,
        num_clients=6,
        total_rounds=4,
        local={
            "local_epochs": 1,
            "local_steps": 3,
            "batch_size": 32,
            "momentum": 0.9,
            "weight_decay": 5e-4,
            "grad_clip": 5.0,
            "precision": "bf16",
            "channels_last": True,
        },
        options=options,
    )
    strategy = create_strategy(method, ctx)
    devices = [DeviceInfo(f"d{i}", i, 40, labels=(0, 1, 2)) for i in range(6)]
    for round_index in (0, 3):
        for task in strategy.assign(round_index, devices).values():
            check_hparams(task.procedure, task.hparams)


@pytest.mark.parametrize("method", sorted(STRATEGIES))
def test_every_option_is_typed_by_its_record(method: str) -> None:
    """Every default passes its own record's check; a value of the wrong kind is refused naming the option."""
    from nestling.errors import ConfigError

    cls = STRATEGIES[method]
    record = cls.options_type
    assert cls.option_defaults == record.defaults()
    built = record.from_table(
        method, {k: list(v) if isinstance(v, tuple) else v for k, v in cls.option_defaults.items()}
    )
    assert built == record()
    for key in cls.option_defaults:
        with pytest.raises(ConfigError, match=f"{method} option {key} must be"):
            record.from_table(method, {key: 3.5j})  # a complex number is no option's kind
        with pytest.raises(ConfigError, match=f"{method} option {key} must be"):
            record.from_table(method, {key: {"text"}})
