"""A birth followed by soft aggregation with no training keeps the child's function (issue 29 item 1).

Net2Wider divides the consumer's input columns by each unit's replication count; soft aggregation must place
the parent's columns divided the same way, or one aggregation right after a birth would pull the child back
towards the undivided columns (logits moved by up to 1.14 before the fix). Checked in float64 on every family
FedTrans grows, for a widen, a deepen, both at once, a grandchild (divisors composed along the lineage), and
with large-to-small sharing (the parent is unchanged too)."""

from __future__ import annotations

import pytest
import torch

from nestling.methods.fedtrans import Lineage, soft_aggregate, transform, widen
from nestling.methods.fedtrans.cells import compose, layout_of, provenance_from_list, provenance_to_list
from nestling.models import ModelConfig
from tests.methods.fedtrans.growth_helpers import outputs, tiny_vit, trained_looking

SMALL_LAYOUT = {
    "stage_blocks": [1, 1, 1, 1],
    "block_hidden": [8, 8, 8, 8],
}  # ResNet-18's blocks, thin and short
FAMILIES = {
    "resnet20": ModelConfig("resnet20", image_size=8),
    "preresnet20": ModelConfig("preresnet20", image_size=8),
    "resnet18-cifar": ModelConfig("resnet18-cifar", image_size=8, extra={"layout": SMALL_LAYOUT}),
    "resnet18": ModelConfig("resnet18", image_size=32, extra={"layout": SMALL_LAYOUT}),
    "tinycnn": ModelConfig("tinycnn", image_size=8),
    "vit": tiny_vit(),
}
TIGHT = 1e-12  # float64: the function is kept up to rounding, not approximately


def _x(config: ModelConfig) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(
        4, config.in_channels, config.image_size, config.image_size, generator=g, dtype=torch.float64
    )


def _born(
    config: ModelConfig, operations: tuple[int, ...]
) -> tuple[Lineage, list[dict[str, torch.Tensor]], ModelConfig]:
    """The seed (trained-looking, float64) and one child grown from its cells 0 and 1 by `operations` done."""
    parent = trained_looking(config, dtype=torch.float64)
    cells = len(layout_of(config).block_hidden)
    done = [0] * cells
    done[0], done[1] = operations
    grown = transform(parent, config, [0, 1], done, torch.Generator().manual_seed(5))
    lineage = Lineage.seeded(cells)
    lineage.add(0, grown.provenance)
    return lineage, [parent, grown.state], grown.config


def _assert_same_function(
    config: ModelConfig, before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]
) -> None:
    x = _x(config)
    for train in (False, True):
        torch.testing.assert_close(
            outputs(config, after, x, train=train),
            outputs(config, before, x, train=train),
            rtol=TIGHT,
            atol=TIGHT,
        )


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("operations", [(0, 0), (1, 1), (0, 1)], ids=["widen", "deepen", "widen+deepen"])
def test_aggregation_right_after_a_birth_keeps_the_childs_function(
    family: str, operations: tuple[int, int]
) -> None:
    config = FAMILIES[family]
    lineage, states, child_config = _born(config, operations)
    assert lineage.similarity(0, 1) > 0  # the parent does feed the child
    # both models trained (uploads unchanged) with large-to-small sharing, then the parent alone trained
    for averaged, l2s in (({0: states[0], 1: states[1]}, True), ({0: states[0]}, False)):
        parent, child = soft_aggregate(states, averaged, lineage, round_index=0, eta=0.98, l2s=l2s)
        _assert_same_function(child_config, states[1], child)
        if l2s:
            _assert_same_function(config, states[0], parent)


@pytest.mark.parametrize("family", ["resnet20", "vit"])
def test_a_grandchild_widened_twice_keeps_its_function_under_its_grandparents_share(family: str) -> None:
    config = FAMILIES[family]
    seed = trained_looking(config, dtype=torch.float64)
    first = widen(seed, config, 1, 2.0, torch.Generator().manual_seed(1))
    second = widen(first.state, first.config, 1, 1.5, torch.Generator().manual_seed(2))
    lineage = Lineage.seeded(len(layout_of(config).block_hidden))
    lineage.add(0, first.provenance)
    lineage.add(1, second.provenance)
    composed = lineage.correspondence(0, 2)
    assert (
        composed is not None
        and composed[1].divisors == compose(first.provenance, second.provenance)[1].divisors
    )
    states = [seed, first.state, second.state]
    _, _, grandchild = soft_aggregate(states, {0: seed}, lineage, round_index=0)
    _assert_same_function(second.config, second.state, grandchild)


def test_divisors_are_the_replication_counts_and_survive_a_checkpoint() -> None:
    config = FAMILIES["resnet20"]
    grown = widen(trained_looking(config), config, 2, 2.0, torch.Generator().manual_seed(0))
    origin = grown.provenance[2]
    assert origin.consumer == "conv2.weight"
    assert len(origin.divisors) == 16 and sum(origin.divisors) == 32  # every one of the 32 units counted once
    assert provenance_from_list(provenance_to_list(grown.provenance)) == grown.provenance
    old_row = provenance_to_list(grown.provenance)[2][:3]  # a checkpoint written before divisors existed
    assert provenance_from_list([old_row])[0].divisors == ()
