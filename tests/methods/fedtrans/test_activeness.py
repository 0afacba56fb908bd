"""Cell activeness and selection (METHODS §4.a.2 8b-c): ‖mean aggregated update‖ / ‖weights‖ per cell over the
last T_act rounds; BN statistics are not weights; cells within α of the most active are chosen."""

from __future__ import annotations

import pytest
import torch

from nestling.errors import ConfigError
from nestling.methods.fedtrans import cell_activeness, select_cells
from nestling.models import ModelConfig
from tests.methods.fedtrans.growth_helpers import IMAGE, trained_looking


def _zero_updates(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items() if v.is_floating_point()}


def test_the_cell_whose_weights_move_most_relative_to_their_size_is_most_active() -> None:
    state = trained_looking(ModelConfig("resnet20", image_size=IMAGE))
    update = _zero_updates(state)
    update["blocks.3.conv1.weight"] = 0.1 * state["blocks.3.conv1.weight"]
    update["blocks.5.conv2.weight"] = 0.01 * state["blocks.5.conv2.weight"]
    update["blocks.6.bn1.running_mean"] = torch.full_like(
        state["blocks.6.bn1.running_mean"], 100.0
    )  # not a weight
    update["stem.conv.weight"] = state["stem.conv.weight"]  # the stem is no cell
    act = cell_activeness([update], state)
    assert len(act) == 9
    assert act.index(max(act)) == 3
    assert act[5] > 0 and act[3] > act[5]
    assert act[6] == 0.0
    weights = sum(
        float(v.square().sum())
        for k, v in state.items()
        if k.startswith("blocks.3.") and "running" not in k and "num_batches" not in k
    )
    assert act[3] == pytest.approx(0.1 * float(state["blocks.3.conv1.weight"].norm()) / weights**0.5)


def test_activeness_averages_the_last_t_act_rounds_so_oscillation_cancels() -> None:
    state = trained_looking(ModelConfig("resnet20", image_size=IMAGE))
    up, down = _zero_updates(state), _zero_updates(state)
    up["blocks.1.conv1.weight"] = state["blocks.1.conv1.weight"].clone()
    down["blocks.1.conv1.weight"] = -state["blocks.1.conv1.weight"]
    steady = _zero_updates(state)
    steady["blocks.2.conv1.weight"] = 0.1 * state["blocks.2.conv1.weight"]
    history = [steady, steady, up, down]
    both = cell_activeness(history, state, window=2)
    assert both[1] == 0.0 and both[2] == 0.0
    longer = cell_activeness(history, state, window=4)
    assert longer[1] == 0.0 and longer[2] > 0.0


def test_selection_keeps_cells_within_alpha_of_the_most_active() -> None:
    assert select_cells([0.1, 0.95, 1.0, 0.89], alpha=0.9) == [1, 2]
    assert select_cells([0.1, 0.95, 1.0, 0.89], alpha=0.0) == [0, 1, 2, 3]
    assert select_cells([0.0, 0.0]) == [0, 1]


def test_bad_activeness_inputs_are_refused_by_name() -> None:
    state = trained_looking(ModelConfig("resnet20", image_size=IMAGE))
    with pytest.raises(ConfigError, match="at least one round"):
        cell_activeness([], state)
    with pytest.raises(ConfigError, match=r"updates \[0\] do not hold blocks\.0\."):
        cell_activeness([{}], state)
    with pytest.raises(ConfigError, match="alpha must be in"):
        select_cells([1.0], alpha=1.5)
