"""Saved-tensor metering: each storage once, parameters excluded, attribution by part; gradient/optimizer bytes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nestling.profiler.memory import (
    SavedTensorMeter,
    gradient_bytes,
    model_tensors,
    optimizer_bytes,
    parameter_bytes,
    return_freed_memory_to_os,
    rss_bytes,
    tensor_bytes,
)


def test_a_tensor_saved_by_two_ops_counts_once() -> None:
    x = torch.randn(4, 1000, requires_grad=True)
    with SavedTensorMeter() as meter:
        y = x * 2.0  # saves nothing (constant factor)
        a = y.sin()  # saves y
        b = y.cos()  # saves y again: same storage
    assert meter.total_bytes == y.numel() * 4
    (a + b).sum().backward()


def test_views_share_their_storage_and_parameters_are_excluded() -> None:
    linear = nn.Linear(100, 50)
    x = torch.randn(8, 200, requires_grad=True)
    with SavedTensorMeter(model_tensors(linear)) as meter:
        out = linear(x[:, :100])  # the view keeps all of x alive: its whole storage is what backward holds
    assert meter.total_bytes == x.numel() * 4
    out.sum().backward()


def test_parts_are_labelled_by_module_and_shared_storages_appear_in_both() -> None:
    first, second = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
    x = torch.randn(2, 3, 8, 8)
    with SavedTensorMeter([*model_tensors(first), *model_tensors(second)]) as meter:
        handles = meter.attach([("first", first), ("second", second)])
        h = F.relu(first(x))  # relu keeps h (labelled "first")
        out = second(h)  # conv keeps h too (labelled "second")
    for handle in handles:
        handle.remove()
    h_bytes = h.numel() * 4
    assert meter.bytes_of("first") == x.numel() * 4 + h_bytes
    assert meter.bytes_of("second") == h_bytes
    assert meter.total_bytes == x.numel() * 4 + h_bytes
    with meter.part("loss"):
        assert meter.label == "loss"
    assert meter.label == "second"
    out.sum().backward()


def test_nothing_is_saved_without_autograd() -> None:
    net = nn.Sequential(nn.Linear(10, 10), nn.ReLU())
    with SavedTensorMeter(model_tensors(net)) as meter, torch.no_grad():
        net(torch.randn(3, 10))
    assert meter.total_bytes == 0


def test_gradient_and_momentum_bytes_follow_the_trainable_parameters() -> None:
    net = nn.Sequential(nn.Linear(10, 20), nn.BatchNorm1d(20), nn.Linear(20, 3))
    net[0].weight.requires_grad_(False)
    trainable = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.1, momentum=0.9)
    net(torch.randn(4, 10)).sum().backward()
    optimizer.step()
    expected = tensor_bytes(trainable)
    assert gradient_bytes(net.parameters()) == expected
    assert optimizer_bytes(optimizer) == expected
    assert optimizer_bytes(optimizer, [net[2].weight]) == net[2].weight.numel() * 4
    assert parameter_bytes(net) == tensor_bytes(net.parameters()) + tensor_bytes(net.buffers())


def test_rss_follows_a_large_allocation_once_malloc_returns_memory() -> None:
    assert return_freed_memory_to_os()
    before = rss_bytes()
    block = torch.ones(16 * 2**20 // 4)  # 16 MiB, touched
    grown = rss_bytes() - before
    del block
    return_freed_memory_to_os()  # a long-lived process may have served it from an old heap chunk
    assert 14 * 2**20 < grown < 24 * 2**20
    assert rss_bytes() - before < 4 * 2**20
