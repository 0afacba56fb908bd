"""Real training: a ResNet-20 with expanded convs trains, fuses back exactly, and both protocols' rounds run."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nestling.methods.dynamicfl.modulation import current_structure
from nestling.methods.dynamicfl.rounds import paper_round, released_round
from nestling.methods.dynamicfl.salience import SalienceMeter, top_salient
from nestling.methods.dynamicfl.sites import ConvSite, expand_model, expanded_blocks, find_sites, fuse_model
from nestling.methods.dynamicfl.state import DynamicState
from tests.methods.dynamicfl.reparam_helpers import resnet

Data = list[tuple[torch.Tensor, torch.Tensor]]


def _data(count: int = 3, seed: int = 0) -> Data:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 3, 32, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator))
        for _ in range(count)
    ]


def _trainer(data: Data, lr: float = 0.05) -> Callable[[nn.Module, Callable[[], None]], None]:
    def train_epoch(model: nn.Module, after_backward: Callable[[], None]) -> None:
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        for x, y in data:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            after_backward()
            optimizer.step()

    return train_epoch


def _shapes(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def _global() -> tuple[nn.Module, list[ConvSite]]:
    net = resnet(dtype=torch.float32)
    return net, find_sites(net, (3, 32, 32))


def test_resnet20_with_two_expanded_convs_trains_and_fuses_to_the_same_function() -> None:
    net, sites = _global()
    original = {k: v.clone() for k, v in net.state_dict().items()}
    shapes = _shapes(net)
    data = _data()
    meter = SalienceMeter(net, sites)
    _trainer(data)(net, meter.record)  # epoch 0 on the plain model, as the released code does
    chosen = top_salient(meter.means(), 2, sites)
    expand_model(
        net,
        sites,
        dict.fromkeys(chosen),
        batches=[x for x, _ in data],
        generator=torch.Generator().manual_seed(0),
    )
    assert len(expanded_blocks(net)) == 2
    train_epoch = _trainer(data)
    for _ in range(3):
        train_epoch(net, lambda: None)
    net.eval()
    probe = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expanded = net(probe)
        biases = [block.equivalent()[1].abs().max() for block in expanded_blocks(net).values()]
        fuse_model(net)
        fused = net(probe)
    assert min(biases) > 1e-4, "training moved the branches: the fused bias is real and must be folded"
    assert (fused - expanded).abs().max() <= 1e-5
    assert _shapes(net) == shapes
    assert not torch.equal(net.state_dict()[f"{chosen[0]}.weight"], original[f"{chosen[0]}.weight"])


def test_released_round_with_capacity_zero_is_plain_local_training() -> None:
    net, sites = _global()
    plain = copy.deepcopy(net)
    data = _data()
    torch.manual_seed(3)
    outcome = released_round(net, sites, 0, 2, _trainer(data))
    torch.manual_seed(3)
    for _ in range(2):
        _trainer(data)(plain, lambda: None)
    assert outcome.structure == {} and outcome.plan.empty
    reference = plain.state_dict()
    assert all(torch.equal(v, reference[k]) for k, v in net.state_dict().items())


def test_released_round_grows_the_top_convs_and_returns_the_plain_model() -> None:
    net, sites = _global()
    shapes = _shapes(net)
    outcome = released_round(
        net,
        sites,
        2,
        2,
        _trainer(_data()),
        calibration=[x for x, _ in _data(2, seed=5)],
        generator=torch.Generator().manual_seed(0),
    )
    assert len(outcome.structure) == 2 and all(len(b) == 7 or len(b) == 6 for b in outcome.structure.values())
    assert outcome.plan.grow == tuple(outcome.structure)
    assert set(outcome.local_salience) == {s.name for s in sites}
    assert expanded_blocks(net) == {} and _shapes(net) == shapes
    assert outcome.to_dict()["expanded"] == 2


def test_paper_protocol_keeps_structure_across_rounds_and_shrinks_with_the_budget() -> None:
    net, sites = _global()
    shapes = _shapes(net)
    state = DynamicState()
    data, calibration = _data(), [x for x, _ in _data(2, seed=5)]
    generator = torch.Generator().manual_seed(0)

    first = paper_round(
        net, sites, state, 2, 2, _trainer(data), round_index=0, calibration=calibration, generator=generator
    )
    assert tuple(first.structure) == (sites[0].name, sites[1].name)  # round 0: bottom to top
    assert state.round == 0 and set(state.branches) == set(first.structure) and first.global_salience == {}
    assert _shapes(net) == shapes and expanded_blocks(net) == {}

    state = DynamicState.from_store(state.to_store())  # as the agent's state file would keep it
    second = paper_round(
        net, sites, state, 2, 2, _trainer(data), round_index=1, calibration=calibration, generator=generator
    )
    assert len(second.structure) <= 2 and set(second.global_salience) == {s.name for s in sites}
    assert state.history_rounds == [0, 1] and state.structure == second.structure

    third = paper_round(
        net, sites, state, 1, 2, _trainer(data), round_index=2, calibration=calibration, generator=generator
    )
    assert len(third.structure) == 1 and third.global_salience == {}  # budget shrink: S^l only, no DYMM
    assert tuple(third.structure) == top_salient(second.local_salience, 1, sites)
    assert _shapes(net) == shapes and current_structure(net) == {}


def test_paper_protocol_with_capacity_zero_is_plain_local_training() -> None:
    net, sites = _global()
    plain = copy.deepcopy(net)
    data = _data()
    state = DynamicState()
    for round_index in range(2):
        paper_round(net, sites, state, 0, 2, _trainer(data), round_index=round_index)
        for _ in range(2):
            _trainer(data)(plain, lambda: None)
    reference = plain.state_dict()
    assert all(torch.equal(v, reference[k]) for k, v in net.state_dict().items())
    assert state.structure == {} and len(state.history) == 2


def test_rounds_refuse_impossible_settings() -> None:
    net, sites = _global()
    with pytest.raises(ValueError, match="at least one local epoch"):
        released_round(net, sites, 1, 0, _trainer(_data()))
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        paper_round(net, sites, DynamicState(), -1, 1, _trainer(_data()), round_index=0)
