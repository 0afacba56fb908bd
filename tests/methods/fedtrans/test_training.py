"""The kernel on real training (UCI digits, 8×8): a grown model starts exactly where its parent stopped and
keeps learning, and a few FedTrans rounds run end to end through every kernel function — DoC triggers a
transformation of the most active cells, the child inherits utilities, assignment respects capacity, and
soft aggregation feeds the child from its parent but never the reverse."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

from nestling.methods.fedtrans import (
    Lineage,
    TrainingReport,
    cell_activeness,
    compatible_models,
    fedavg,
    inherit_utilities,
    layout_of,
    model_macs,
    sample_model,
    select_cells,
    should_transform,
    soft_aggregate,
    transform,
    update_utilities,
)
from nestling.models import ModelConfig
from tests.methods.fedtrans.growth_helpers import net_of

CONFIG = ModelConfig("resnet20", num_classes=10, in_channels=1, image_size=8)


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    digits = load_digits()
    x = torch.from_numpy(digits.images).float().unsqueeze(1) / 16.0
    return (x - 0.3) / 0.4, torch.from_numpy(digits.target).long()


def _train(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    seed: int,
) -> tuple[dict[str, torch.Tensor], float]:
    """`steps` SGD steps (batch 10, lr 0.05 as METHODS §4.a.2) from `state`; the new state and the mean loss."""
    net = net_of(config, {k: v.clone() for k, v in state.items()}, train=True)
    optimiser = torch.optim.SGD(net.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        batch = torch.randint(0, len(x), (10,), generator=g)
        loss = F.cross_entropy(net(x[batch]), y[batch])  # type: ignore[arg-type]
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, sum(losses) / len(losses)


def _loss(config: ModelConfig, state: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> float:
    net = net_of(config, {k: v.clone() for k, v in state.items()}, train=False)
    with torch.no_grad():
        return float(F.cross_entropy(net(x), y))  # type: ignore[arg-type]


def test_a_grown_model_starts_at_its_parents_loss_and_keeps_learning() -> None:
    torch.manual_seed(0)
    x, y = _digits()
    from nestling.models import build
    from nestling.spec import SubmodelSpec

    seed_state = {k: v.detach().clone() for k, v in build(SubmodelSpec(CONFIG)).state_dict().items()}
    parent, _ = _train(CONFIG, seed_state, x[:1200], y[:1200], 60, seed=1)
    grown = transform(
        parent, CONFIG, [1, 4, 7], [0, 0, 0, 0, 1, 0, 0, 0, 0], torch.Generator().manual_seed(2)
    )
    assert [op for op, _ in grown.applied] == ["widen", "widen", "deepen"]
    held_out_x, held_out_y = x[1200:], y[1200:]
    before = _loss(CONFIG, parent, held_out_x, held_out_y)
    assert abs(_loss(grown.config, grown.state, held_out_x, held_out_y) - before) < 1e-5
    child, _ = _train(grown.config, grown.state, x[:1200], y[:1200], 80, seed=3)
    assert _loss(grown.config, child, held_out_x, held_out_y) < before


def test_fedtrans_rounds_run_end_to_end_through_the_kernel() -> None:
    torch.manual_seed(0)
    x, y = _digits()
    from nestling.models import build
    from nestling.spec import SubmodelSpec

    configs = [CONFIG]
    states = [{k: v.detach().clone() for k, v in build(SubmodelSpec(CONFIG)).state_dict().items()}]
    lineage = Lineage.seeded(9)
    operations = [(0,) * 9]
    losses: list[list[float]] = [[]]
    updates: list[list[dict[str, torch.Tensor]]] = [[]]
    macs = [model_macs(CONFIG)]
    capacity = {f"c{i}": macs[0] * (1.0 if i < 3 else 3.0) for i in range(6)}
    utilities = {c: [0.0] for c in capacity}
    shards = {c: (x[i * 250 : (i + 1) * 250], y[i * 250 : (i + 1) * 250]) for i, c in enumerate(capacity)}
    births = []
    for round_index in range(8):
        fits = {c: compatible_models(macs, capacity[c]) for c in capacity}
        picks = {
            c: sample_model(utilities[c], fits[c], seed=0, round_index=round_index, client=c)
            for c in capacity
        }
        assert all(macs[picks[c]] <= capacity[c] for c in capacity)
        uploads: dict[int, list[dict[str, torch.Tensor]]] = {}
        reports = []
        for n, c in enumerate(sorted(capacity)):
            new_state, loss = _train(
                configs[picks[c]], states[picks[c]], *shards[c], steps=5, seed=100 * round_index + n
            )
            uploads.setdefault(picks[c], []).append(new_state)
            reports.append(TrainingReport(c, picks[c], loss))
        utilities = update_utilities(utilities, reports, fits, lineage.similarity)
        averaged = {m: fedavg(ups, [1.0] * len(ups)) for m, ups in uploads.items()}
        for m, mean in averaged.items():
            losses[m].append(sum(r.loss for r in reports if r.model == m) / len(uploads[m]))
            updates[m].append({k: states[m][k] - mean[k] for k in mean if mean[k].is_floating_point()})
        new_states = soft_aggregate(states, averaged, lineage, round_index, eta=0.98)
        if 0 in averaged:
            assert all(
                torch.equal(new_states[0][k], averaged[0][k]) for k in averaged[0]
            )  # never from larger
        states = new_states
        newest = len(states) - 1
        if should_transform(
            losses[newest], macs[newest], max(capacity.values()), beta=10.0, gamma=2, delta=1
        ):
            cells = select_cells(cell_activeness(updates[newest], states[newest], window=5), alpha=0.9)
            grown = transform(
                states[newest],
                configs[newest],
                cells,
                operations[newest],
                torch.Generator().manual_seed(round_index),
            )
            lineage.add(newest, grown.provenance)
            configs.append(grown.config)
            states.append(grown.state)
            operations.append(grown.operations_done)
            losses.append([])
            updates.append([])
            macs.append(model_macs(grown.config))
            utilities = inherit_utilities(utilities, newest)
            births.append((round_index, newest, cells))
    assert births and births[0][0] == 2  # γ + δ = 3 loss entries: the first check that can fire
    assert len(states) >= 2 and macs[1] > macs[0]
    assert layout_of(configs[1]) != layout_of(configs[0])
    assert 0 < lineage.similarity(0, 1) < 1
    strong = [c for c in capacity if capacity[c] > macs[0]]
    assert all(len(utilities[c]) == len(states) for c in capacity)
    assert any(1 in compatible_models(macs, capacity[c]) for c in strong)
