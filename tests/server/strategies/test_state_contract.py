"""Every strategy's aggregate replaces its state tensors and never writes into them.

The coordinator's divergence guard keeps the state before a round by reference (no copy per round) and rolls
back to it; that is only sound if aggregation leaves the old tensors as they were. Checked on every method.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nestling.server.strategies import STRATEGIES, DeviceInfo, create_strategy


@pytest.mark.parametrize("method", sorted(STRATEGIES))
def test_aggregate_leaves_the_previous_state_tensors_untouched(
    method: str, make_ctx: Any, fake_result: Any
) -> None:
    strategy = create_strategy(method, make_ctx(arch="resnet20", image_size=32, num_clients=6))
    devices = [DeviceInfo(f"dev-{i:05d}", i, 20) for i in range(6)]
    for round_index in range(2):
        before = strategy.state_tensors()
        copies = {k: v.clone() for k, v in before.items()}
        meta = strategy.state_meta()
        tasks = list(strategy.assign(round_index, devices).values())
        results = [
            fake_result(task, seed=10 * round_index + i, num_samples=20) for i, task in enumerate(tasks)
        ]
        strategy.aggregate(round_index, list(zip(tasks, results, strict=True)))
        changed = [k for k in before if not torch.equal(before[k], copies[k])]
        assert not changed, f"{method} wrote into its previous state in place: {changed[:4]}"
        assert any(not torch.equal(strategy.state_tensors()[k], copies[k]) for k in copies), (
            "nothing aggregated"
        )
        strategy.load_state(before, meta)  # the guard's rollback restores exactly the old values
        assert all(torch.equal(strategy.state_tensors()[k], copies[k]) for k in copies)
        strategy.aggregate(round_index, list(zip(tasks, results, strict=True)))
