"""Methods of a comparison whose settings come from another method's finished run of the same seed.

FedTrans's protocol has two phases (METHODS §4.c): FedTrans grows its family, then each baseline trains
FedTrans's final largest model as its full model, every capacity tier at the widest width that fits the tier's
capacity T_c (the same MACs FedTrans compared its models with). `nestling reproduce fedtrans` runs both: the
HeteroFL entry of examples/reproduce/fedtrans.toml derives from the FedTrans entry by the rule
"fedtrans-largest".
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nestling.config import SimConfig
from nestling.errors import ConfigError

Derived = tuple[dict[str, Any], dict[str, Any]]  # (method options, [model] table changes)


def heterofl_on_fedtrans_largest(source: SimConfig, source_run: Path | None) -> Derived:
    """HeteroFL's `mix` (one rate letter per FedTrans tier, in FedTrans's tier order by client index) and the
    [model] layout of FedTrans's final largest model; before FedTrans ran, its seed model stands in."""
    from nestling.server.strategies.fedtrans import FedTrans

    capacities = [
        float(c) for c in source.method.options.get("capacities", FedTrans.option_defaults["capacities"])
    ]
    if source_run is None:
        return {"mix": "-".join("a1" for _ in capacities)}, {}
    summary_path = source_run / "summary.json"
    if not summary_path.is_file():
        raise ConfigError(
            f"{source_run} has no summary.json: FedTrans must finish before HeteroFL derives from it"
        )
    report = json.loads(summary_path.read_text()).get("method_report", {}).get("fedtrans")
    if not report or not report.get("models"):
        raise ConfigError(f"{summary_path} holds no FedTrans family (method_report.fedtrans.models)")
    largest, seed_macs = report["models"][-1], float(report["models"][0]["macs"])
    layout = {"stage_blocks": list(largest["stage_blocks"]), "block_hidden": list(largest["block_hidden"])}
    letters = [_widest_fitting(source, layout, capacity * seed_macs) for capacity in capacities]
    extra = {**dict(source.model.extra), "layout": layout}
    return {"mix": "-".join(f"{letter}1" for letter in letters)}, {"extra": extra}


def _widest_fitting(source: SimConfig, layout: dict[str, Any], capacity_macs: float) -> str:
    """The widest HeteroFL rate letter whose submodel of the largest model costs at most `capacity_macs`."""
    from nestling.models.config import ModelConfig
    from nestling.models.cost import count_macs
    from nestling.models.zoo import build
    from nestling.server.strategies.heterofl import RATE_LETTERS
    from nestling.simulator.fleetdata import load_fleet_data
    from nestling.simulator.run import fleet_args
    from nestling.spec import SubmodelSpec

    bundle = load_fleet_data(**fleet_args(source)).bundle
    channels, size, _ = bundle.input_shape
    model = ModelConfig(
        source.model.arch,
        bundle.num_classes,
        channels,
        size,
        norm_stats="batch",
        scaler="train",
        extra={**dict(source.model.extra), "layout": layout},
    )
    for letter, rate in RATE_LETTERS.items():  # widest first
        if (
            count_macs(build(SubmodelSpec(model, width=rate), init=False), bundle.input_shape)
            <= capacity_macs
        ):
            return letter
    return list(RATE_LETTERS)[-1]


RULES: dict[str, Callable[[SimConfig, Path | None], Derived]] = {
    "fedtrans-largest": heterofl_on_fedtrans_largest,
}


def derived_settings(rule: str, source: SimConfig, source_run: Path | None) -> Derived:
    """The options and [model] changes `rule` derives from `source`'s run (None: not run yet)."""
    if rule not in RULES:
        raise ConfigError(f"unknown derivation rule {rule!r} (known: {', '.join(sorted(RULES))})")
    return RULES[rule](source, source_run)
