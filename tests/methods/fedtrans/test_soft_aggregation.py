"""FedAvg within a model and soft aggregation between models (METHODS §4.b 6): one model is plain FedAvg, a
vanishing decay leaves each model's own FedAvg, a smaller model never moves because of a larger one, and
every element is a convex combination of the models that hold it."""

from __future__ import annotations

import pytest
import torch

from nestling.errors import ConfigError
from nestling.methods.fedtrans import Lineage, deepen, fedavg, soft_aggregate, widen
from nestling.methods.fedtrans.cells import compose
from nestling.models import ModelConfig
from tests.methods.fedtrans.growth_helpers import IMAGE, trained_looking


def _perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        k: v + 0.1 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()
        for k, v in state.items()
    }


def _two_models() -> tuple[Lineage, list[dict[str, torch.Tensor]]]:
    """Seed resnet20 and a child with cell 1 widened and a block inserted in stage 0 after cell 1."""
    config = ModelConfig("resnet20", image_size=IMAGE)
    seed = trained_looking(config)
    wide = widen(seed, config, 1, 2.0, torch.Generator().manual_seed(0))
    deep = deepen(wide.state, wide.config, 0, 2, torch.Generator().manual_seed(1))
    lineage = Lineage.seeded(9)
    lineage.add(0, compose(wide.provenance, deep.provenance))  # one model grown by two operations
    return lineage, [seed, deep.state]


def test_fedavg_is_the_sample_weighted_mean() -> None:
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    b = {"w": torch.tensor([4.0, 8.0]), "n": torch.tensor(5)}
    mean = fedavg([a, b], [1, 2])
    torch.testing.assert_close(mean["w"], torch.tensor([3.0, 6.0]))
    assert int(mean["n"]) == 3
    with pytest.raises(ConfigError, match="one weight per state"):
        fedavg([a], [1, 2])
    with pytest.raises(ConfigError, match="positive sum"):
        fedavg([a], [0])


def test_one_model_is_plain_fedavg() -> None:
    state = trained_looking(ModelConfig("resnet20", image_size=IMAGE))
    uploads = [_perturbed(state, s) for s in range(3)]
    averaged = fedavg(uploads, [10, 20, 30])
    (result,) = soft_aggregate([state], {0: averaged}, Lineage.seeded(9), round_index=4)
    assert all(torch.equal(result[k], averaged[k]) for k in averaged)


def test_a_smaller_model_is_never_changed_by_a_larger_one() -> None:
    lineage, states = _two_models()
    small_avg, large_avg = _perturbed(states[0], 1), _perturbed(states[1], 2)
    small, large = soft_aggregate(states, {0: small_avg, 1: large_avg}, lineage, round_index=0)
    assert all(torch.equal(small[k], small_avg[k]) for k in small_avg)
    assert not torch.equal(large["stem.conv.weight"], large_avg["stem.conv.weight"])
    only_large = soft_aggregate(states, {1: large_avg}, lineage, round_index=0)
    assert all(torch.equal(only_large[0][k], states[0][k]) for k in states[0])  # no uploads: unchanged


def test_a_vanishing_decay_leaves_each_models_own_fedavg() -> None:
    lineage, states = _two_models()
    small_avg, large_avg = _perturbed(states[0], 1), _perturbed(states[1], 2)
    _, exact = soft_aggregate(states, {0: small_avg, 1: large_avg}, lineage, round_index=3, eta=0.0)
    assert all(torch.equal(exact[k], large_avg[k]) for k in large_avg)
    _, late = soft_aggregate(states, {0: small_avg, 1: large_avg}, lineage, round_index=5000, eta=0.98)
    for key in large_avg:
        torch.testing.assert_close(late[key], large_avg[key], rtol=0, atol=1e-12)


def test_every_element_is_the_renormalised_mix_of_the_models_that_hold_it() -> None:
    lineage, states = _two_models()
    small_avg, large_avg = _perturbed(states[0], 1), _perturbed(states[1], 2)
    t, eta = 3, 0.9
    _, large = soft_aggregate(states, {0: small_avg, 1: large_avg}, lineage, round_index=t, eta=eta)
    w = eta**t * lineage.similarity(0, 1)
    assert 0 < w < 1

    def mix(own: torch.Tensor, older: torch.Tensor) -> torch.Tensor:
        return ((own.double() + w * older.double()) / (1 + w)).to(own.dtype)

    # Shared stem and head: every element mixed.
    torch.testing.assert_close(
        large["stem.conv.weight"], mix(large_avg["stem.conv.weight"], small_avg["stem.conv.weight"])
    )
    # Widened cell 1: its first 16 hidden units mixed with the seed's, the 16 new ones keep their own FedAvg.
    own, old = large_avg["blocks.1.conv1.weight"], small_avg["blocks.1.conv1.weight"]
    torch.testing.assert_close(large["blocks.1.conv1.weight"][:16], mix(own[:16], old))
    assert torch.equal(large["blocks.1.conv1.weight"][16:], own[16:])
    # The inserted block (index 2) has no counterpart; the seed's block 2 now sits at index 3.
    assert all(torch.equal(large[k], large_avg[k]) for k in large_avg if k.startswith("blocks.2."))
    torch.testing.assert_close(
        large["blocks.3.conv2.weight"],
        mix(large_avg["blocks.3.conv2.weight"], small_avg["blocks.2.conv2.weight"]),
    )
    assert torch.equal(
        large["blocks.3.bn1.num_batches_tracked"], large_avg["blocks.3.bn1.num_batches_tracked"]
    )


def test_a_larger_model_without_uploads_still_learns_from_an_older_one() -> None:
    lineage, states = _two_models()
    small_avg = _perturbed(states[0], 1)
    _, large = soft_aggregate(states, {0: small_avg}, lineage, round_index=0)
    assert not torch.equal(large["head.fc.weight"], states[1]["head.fc.weight"])


def test_mismatched_inputs_are_refused_by_name() -> None:
    lineage, states = _two_models()
    with pytest.raises(ConfigError, match="the lineage holds 2"):
        soft_aggregate(states[:1], {}, lineage, 0)
    with pytest.raises(ConfigError, match=r"models \[5\]"):
        soft_aggregate(states, {5: states[0]}, lineage, 0)
    with pytest.raises(ConfigError, match="0 <= eta <= 1"):
        soft_aggregate(states, {}, lineage, 0, eta=1.5)


# -- l2s (large-to-small sharing): off by default, on request the same rule runs from newer to older models -----


def test_with_l2s_a_smaller_model_learns_from_a_larger_one_by_the_same_rule() -> None:
    lineage, states = _two_models()
    small_avg, large_avg = _perturbed(states[0], 1), _perturbed(states[1], 2)
    t, eta = 3, 0.9
    averaged = {0: small_avg, 1: large_avg}
    small, large = soft_aggregate(states, averaged, lineage, round_index=t, eta=eta, l2s=True)
    _, large_default = soft_aggregate(states, averaged, lineage, round_index=t, eta=eta)
    assert all(torch.equal(large[k], large_default[k]) for k in large)  # the largest model gets nothing new
    w = eta**t * lineage.similarity(0, 1)

    def mix(own: torch.Tensor, newer: torch.Tensor) -> torch.Tensor:
        return ((own.double() + w * newer.double()) / (1 + w)).to(own.dtype)

    assert not torch.equal(small["stem.conv.weight"], small_avg["stem.conv.weight"])
    torch.testing.assert_close(
        small["stem.conv.weight"], mix(small_avg["stem.conv.weight"], large_avg["stem.conv.weight"])
    )
    torch.testing.assert_close(
        small["head.fc.weight"], mix(small_avg["head.fc.weight"], large_avg["head.fc.weight"])
    )
    # Widened cell 1: the seed's 16 hidden units take the larger model's first 16 (rows of conv1, columns of
    # conv2, the columns multiplied back by the replication counts Net2Wider divided them by).
    torch.testing.assert_close(
        small["blocks.1.conv1.weight"],
        mix(small_avg["blocks.1.conv1.weight"], large_avg["blocks.1.conv1.weight"][:16]),
    )
    counts = torch.tensor(lineage.provenances[1][1].divisors).reshape(1, 16, 1, 1)  # type: ignore[index]
    assert counts.sum() == 32
    torch.testing.assert_close(
        small["blocks.1.conv2.weight"],
        mix(small_avg["blocks.1.conv2.weight"], large_avg["blocks.1.conv2.weight"][:, :16] * counts),
    )
    # The larger model's inserted block 2 feeds nothing; its block 3 is the seed's block 2.
    torch.testing.assert_close(
        small["blocks.2.conv2.weight"],
        mix(small_avg["blocks.2.conv2.weight"], large_avg["blocks.3.conv2.weight"]),
    )
    torch.testing.assert_close(
        small["blocks.8.bn2.running_var"],
        mix(small_avg["blocks.8.bn2.running_var"], large_avg["blocks.9.bn2.running_var"]),
    )
    assert torch.equal(
        small["blocks.2.bn1.num_batches_tracked"], small_avg["blocks.2.bn1.num_batches_tracked"]
    )


def test_with_l2s_one_model_is_still_fedavg_and_a_vanishing_decay_still_leaves_each_own_fedavg() -> None:
    state = trained_looking(ModelConfig("resnet20", image_size=IMAGE))
    averaged = fedavg([_perturbed(state, s) for s in range(3)], [10, 20, 30])
    (alone,) = soft_aggregate([state], {0: averaged}, Lineage.seeded(9), round_index=4, l2s=True)
    assert all(torch.equal(alone[k], averaged[k]) for k in averaged)
    lineage, states = _two_models()
    small_avg, large_avg = _perturbed(states[0], 1), _perturbed(states[1], 2)
    small, large = soft_aggregate(states, {0: small_avg, 1: large_avg}, lineage, 3, eta=0.0, l2s=True)
    assert all(torch.equal(small[k], small_avg[k]) for k in small_avg)
    assert all(torch.equal(large[k], large_avg[k]) for k in large_avg)
    only_large, _ = soft_aggregate(states, {1: large_avg}, lineage, 0, l2s=True)
    assert not torch.equal(
        only_large["head.fc.weight"], states[0]["head.fc.weight"]
    )  # no uploads, still learns
