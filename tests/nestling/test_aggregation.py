"""Masked (count-based) aggregation, METHODS §1.2: w_e ← Σ_{k∈S_e} a_k w_{k,e} / Σ_{k∈S_e} a_k, else unchanged."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nestling.aggregation import Contribution, masked_mean


def region_of(shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


def contribution(tensors: dict[str, torch.Tensor], weight: float = 1.0) -> Contribution:
    return Contribution(tensors, {k: region_of(tuple(v.shape)) for k, v in tensors.items()}, weight)


def brute_force(
    old: torch.Tensor, clients: list[tuple[torch.Tensor, float, np.ndarray | None]]
) -> torch.Tensor:
    """Element by element, straight from the formula (slow, obviously right)."""
    out = old.clone().double()
    for index in itertools.product(*(range(n) for n in old.shape)):
        num = den = 0.0
        for tensor, weight, rows in clients:
            inside = all(i < n for i, n in zip(index, tensor.shape))
            if inside and (rows is None or rows[index[0]]):
                num += weight * float(tensor[index])
                den += weight
        if den > 0:
            out[index] = num / den
    return out.to(old.dtype)


@st.composite
def rounds(draw):
    """A global tensor and several clients holding random leading regions, weights and optional row masks."""
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=rank, max_size=rank)))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    clients = []
    for _ in range(draw(st.integers(1, 5))):
        sub = tuple(draw(st.integers(1, n)) for n in shape)
        weight = draw(st.sampled_from([1.0, 2.0, 0.5, 37.0]))
        rows = None
        if draw(st.booleans()):
            rows = np.array(draw(st.lists(st.booleans(), min_size=shape[0], max_size=shape[0])))
        clients.append((torch.randn(sub, generator=generator, dtype=torch.float64), weight, rows))
    return torch.randn(shape, generator=generator, dtype=torch.float64), clients


@settings(max_examples=150, deadline=None)
@given(rounds())
def test_masked_mean_equals_the_elementwise_formula_on_random_draws(draw) -> None:
    old, clients = draw
    contributions = []
    for tensor, weight, rows in clients:
        c = contribution({"w": tensor}, weight)
        if rows is not None:
            c.row_masks["w"] = torch.as_tensor(rows[: tensor.shape[0]].copy())
        contributions.append(c)
    result = masked_mean({"w": old}, contributions)["w"]
    torch.testing.assert_close(result, brute_force(old, clients), rtol=1e-12, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(rounds(), st.randoms(use_true_random=False))
def test_masked_mean_does_not_depend_on_client_order(draw, random) -> None:
    old, clients = draw
    contributions = [contribution({"w": t}, w) for t, w, _ in clients]
    shuffled = list(contributions)
    random.shuffle(shuffled)
    torch.testing.assert_close(
        masked_mean({"w": old}, contributions)["w"],
        masked_mean({"w": old}, shuffled)["w"],
        rtol=1e-12,
        atol=1e-12,
    )


def test_all_clients_on_the_full_model_is_exactly_fedavg() -> None:
    generator = torch.Generator().manual_seed(0)
    old = {"a": torch.randn(4, 3, generator=generator), "b": torch.randn(5, generator=generator)}
    states = [{k: torch.randn(v.shape, generator=generator) for k, v in old.items()} for _ in range(4)]
    sizes = [10.0, 30.0, 5.0, 55.0]
    weighted = masked_mean(old, [contribution(s, n) for s, n in zip(states, sizes)])
    uniform = masked_mean(old, [contribution(s) for s in states])
    for key in old:
        fedavg = sum(n * s[key] for s, n in zip(states, sizes)) / sum(sizes)
        torch.testing.assert_close(weighted[key], fedavg, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(
            uniform[key], torch.stack([s[key] for s in states]).mean(0), rtol=1e-6, atol=1e-7
        )


def test_elements_outside_every_submodel_keep_their_exact_value() -> None:
    old = {"w": torch.randn(6, 6), "untouched": torch.randn(3)}
    result = masked_mean(old, [contribution({"w": torch.zeros(2, 3)}), contribution({"w": torch.ones(4, 2)})])
    assert "untouched" not in result  # keys no client holds are not even returned
    w = result["w"]
    assert torch.equal(w[4:], old["w"][4:]) and torch.equal(w[:, 3:], old["w"][:, 3:])
    assert torch.equal(w[2:4, 2], old["w"][2:4, 2])


def test_a_single_covering_client_sets_the_element_to_its_value() -> None:
    old = {"w": torch.randn(4, 4)}
    small, large = torch.full((2, 2), 1.0), torch.arange(16.0).view(4, 4)
    w = masked_mean(old, [contribution({"w": small}), contribution({"w": large})])["w"]
    assert torch.equal(w[2:], large[2:]) and torch.equal(w[:, 2:], large[:, 2:])
    torch.testing.assert_close(w[:2, :2], (small + large[:2, :2]) / 2)


def test_row_masks_leave_rows_no_client_holds_untouched() -> None:
    old = {"head": torch.randn(4, 3)}
    a = contribution({"head": torch.ones(4, 3)})
    a.row_masks["head"] = torch.tensor([True, True, False, False])
    b = contribution({"head": torch.full((4, 3), 3.0)})
    b.row_masks["head"] = torch.tensor([False, True, False, True])
    w = masked_mean(old, [a, b])["head"]
    assert (w[0] == 1).all() and (w[1] == 2).all() and (w[3] == 3).all()
    assert torch.equal(w[2], old["head"][2])


def test_integer_counters_are_not_float_averaged() -> None:
    old = {"n": torch.tensor(5)}
    result = masked_mean(old, [contribution({"n": torch.tensor(7)}), contribution({"n": torch.tensor(9)})])[
        "n"
    ]
    assert result.dtype == torch.int64 and int(result) == 9


def test_data_weights_enter_the_mean() -> None:
    """a_k = n_k (FjORD, FedAvg): a client with three times the data counts three times."""
    contributions = [
        Contribution({"w": torch.ones(2)}, {"w": region_of((2,))}, 3.0),
        Contribution({"w": torch.zeros(2)}, {"w": region_of((2,))}, 1.0),
    ]
    weighted = masked_mean({"w": torch.zeros(2)}, contributions)["w"]
    torch.testing.assert_close(weighted, torch.full((2,), 0.75))
