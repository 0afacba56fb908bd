"""REP expansion keeps the function (METHODS §5.a.3, §5.b.4), recalibration, branch cuts and growth."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from nestling.methods.dynamicfl.dbb import ORIGINAL, DiverseBranchBlock
from nestling.methods.dynamicfl.expansion import (
    LAST_BN_GAMMA,
    absorb,
    cut_branches,
    expand_conv,
    grow_branches,
    recalibrate,
)
from tests.methods.dynamicfl.reparam_helpers import randomise_norms


def _small_net(dtype: torch.dtype = torch.float64, *, bias: bool = False, groups: int = 1) -> nn.Sequential:
    """conv → BN → ReLU → conv → BN with realistic statistics, in eval mode."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(16, 16, 3, 1, 1, groups=groups, bias=bias),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, 2, 1, bias=bias),
        nn.BatchNorm2d(32),
    ).to(dtype)
    randomise_norms(net, torch.Generator().manual_seed(0))
    return net.eval()


def _inputs(count: int, dtype: torch.dtype = torch.float64, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 16, 10, 10, generator=generator, dtype=dtype) for _ in range(count)]


def _expand(net: nn.Sequential, index: int, **kwargs: object) -> DiverseBranchBlock:
    block = expand_conv(net[index], generator=torch.Generator().manual_seed(5), **kwargs)  # type: ignore[arg-type]
    net[index] = block
    return block


@pytest.mark.parametrize(("bias", "groups"), [(False, 1), (True, 1), (False, 2)])
def test_rep_expansion_preserves_eval_outputs(bias: bool, groups: int) -> None:
    net = _small_net(bias=bias, groups=groups)
    x = _inputs(1, seed=9)[0]
    before = net(x)
    blocks = [_expand(net, 0), _expand(net, 3)]
    used = recalibrate(net, blocks, _inputs(25))
    assert used == 20  # METHODS §5.a.7: 20 recalibration batches
    assert (net(x) - before).abs().max() <= 1e-5
    assert not net.training and all(not m.training for m in net.modules())


def test_new_branches_start_small_and_the_kxk_bn_is_the_identity() -> None:
    net = _small_net()
    block = _expand(net, 0)
    for name in block.branch_names:
        gamma = block.branch(name).last_bn.weight
        assert torch.all(gamma == (1.0 if name == ORIGINAL else LAST_BN_GAMMA)), name
    bn = block.original.bn
    assert torch.all(bn.running_mean == 0) and torch.all(bn.running_var == 1.0 - bn.eps)
    assert torch.all(bn.bias == 0)


def test_running_var_one_minus_eps_makes_the_expansion_exact() -> None:
    """With σ² = 1 the K×K path is scaled by 1/√(1+ε), about 5e-6 relative: the DECISION removes it."""
    net = _small_net()
    x = _inputs(1, seed=9)[0]
    before = net[1](net[0](x))
    block = _expand(net, 0)
    with torch.no_grad():
        exact = float((net[1](block(x)) - before).abs().max())
        block.original.bn.running_var.fill_(1.0)
        naive = float((net[1](block(x)) - before).abs().max())
    assert exact <= 1e-10
    assert naive > 100 * max(exact, 1e-14)
    assert naive <= 1e-4


def test_train_mode_starts_near_the_plain_model_with_live_branches() -> None:
    """METHODS §5.a.3: in training the new branches enter at 1% (last-BN γ = 0.01) and all learn."""
    plain = _small_net(torch.float32)
    net = copy.deepcopy(plain)
    blocks = [_expand(net, 0)]
    recalibrate(net, blocks, _inputs(5, torch.float32))
    x = _inputs(1, torch.float32, seed=9)[0]
    plain.train()
    net.train()
    reference, out = plain(x), net(x)
    relative = float((out - reference).detach().norm() / reference.detach().norm())
    assert 1e-4 < relative < 0.05
    out.square().mean().backward()
    for name, parameter in blocks[0].named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


def test_recalibration_averages_the_plain_models_activations_and_restores_momentum() -> None:
    net = _small_net()
    batches = _inputs(4)
    seen: list[torch.Tensor] = []
    handle = net[3].register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0]))
    with torch.no_grad():
        for batch in batches:
            net(batch)
    handle.remove()
    first, second = _expand(net, 0), _expand(net, 3)
    used = recalibrate(net, [first, second], batches, iterations=20)
    assert used == 4
    branch = second.branch("conv1x1")
    with torch.no_grad():
        means = torch.stack([branch.conv(block_input).mean(dim=(0, 2, 3)) for block_input in seen])
    # Cumulative average (momentum None) over the second block's inputs under the *plain* model.
    assert torch.allclose(branch.bn.running_mean, means.mean(0), atol=1e-10)
    assert all(m.momentum == 0.1 for m in net.modules() if isinstance(m, nn.BatchNorm2d))


def test_cut_and_grow_keep_the_function() -> None:
    net = _small_net()
    block = _expand(net, 0)
    recalibrate(net, [block], _inputs(3))
    randomise_norms(block, torch.Generator().manual_seed(11))  # as if trained
    x = _inputs(1, seed=9)[0]
    before = net(x)
    cut_branches(block, ["conv1x1", "identity"])
    assert "conv1x1" not in block.branch_names and "identity" not in block.branch_names
    assert (net(x) - before).abs().max() <= 1e-5
    grow_branches(block, ["identity"], generator=torch.Generator().manual_seed(2))
    assert block.branch_names[-1] == "identity"
    assert (net(x) - before).abs().max() <= 1e-5


def test_cuts_refuse_the_original_and_unknown_branches() -> None:
    block = expand_conv(nn.Conv2d(8, 8, 3, 1, 1))
    with pytest.raises(ValueError, match="cannot be cut"):
        cut_branches(block, [ORIGINAL])
    cut_branches(block, ["conv1x1"])
    with pytest.raises(KeyError, match="no branches \\['conv1x1'\\]"):
        cut_branches(block, ["conv1x1"])
    with pytest.raises(ValueError, match="not available"):
        grow_branches(expand_conv(nn.Conv2d(8, 16, 3, 1, 1)), ["identity"])


def test_absorb_targets_any_conv() -> None:
    block = expand_conv(nn.Conv2d(8, 8, 3, 1, 1).double())
    randomise_norms(block, torch.Generator().manual_seed(4))
    kernel, bias = torch.randn(8, 8, 3, 3, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    absorb(block, kernel, bias)
    fused_kernel, fused_bias = block.eval().equivalent()
    assert torch.allclose(fused_kernel, kernel, atol=1e-12) and torch.allclose(fused_bias, bias, atol=1e-12)
