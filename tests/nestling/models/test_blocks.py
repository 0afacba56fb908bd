"""Residual blocks with step sizes and block skipping (METHODS §2.a.3, §2.b.7, §2.b.10)."""

from __future__ import annotations

import pytest
import torch

from nestling.models import ModelConfig, build
from nestling.spec import SubmodelSpec

RESNET20 = ModelConfig("resnet20", image_size=16)


def test_every_kept_block_starts_with_step_one_and_learns_it_by_default() -> None:
    net = build(SubmodelSpec(RESNET20, width=0.5))
    steps = {n: p for n, p in net.named_parameters() if n.endswith(".step")}
    assert len(steps) == 9
    assert all(float(p.detach()) == 1.0 and p.requires_grad for p in steps.values())


def test_learnable_step_false_freezes_the_step_sizes() -> None:
    net = build(SubmodelSpec(RESNET20.with_(learnable_step=False)))
    steps = [p for n, p in net.named_parameters() if n.endswith(".step")]
    assert steps and all(float(p.detach()) == 1.0 and not p.requires_grad for p in steps)


def test_a_skipped_block_has_no_residual_branch_and_no_step_size() -> None:
    net = build(SubmodelSpec(RESNET20, blocks=(0, 2, 4, 5, 6, 7, 8)))
    keys = set(net.state_dict())
    for skipped in (1, 3):
        assert not any(k.startswith(f"blocks.{skipped}.conv") or k == f"blocks.{skipped}.step" for k in keys)
    # Block 3 enters stage 2: its projection shortcut (conv + BN) is still used by the skipping submodel.
    assert "blocks.3.shortcut.0.weight" in keys and "blocks.3.shortcut.2.weight" in keys


def test_a_skipped_identity_block_is_the_identity_map() -> None:
    torch.manual_seed(0)
    net = build(SubmodelSpec(RESNET20, blocks=(0, 2, 3, 4, 5, 6, 7, 8)))
    net.eval()
    x = torch.relu(torch.randn(2, 16, 8, 8))  # block inputs follow a ReLU
    assert torch.equal(net.blocks[1](x), x)


def test_a_skipped_stage_entry_block_applies_only_its_projection() -> None:
    torch.manual_seed(0)
    net = build(SubmodelSpec(RESNET20, blocks=(0, 1, 2, 4, 5, 6, 7, 8)))
    net.eval()
    x = torch.relu(torch.randn(2, 16, 8, 8))
    block = net.blocks[3]
    assert torch.equal(block(x), torch.relu(block.shortcut(x)))


@pytest.mark.parametrize("skipped", [1, 3])
def test_skipping_equals_a_zero_step_and_the_branch_then_gets_exactly_zero_gradient(skipped: int) -> None:
    torch.manual_seed(0)
    full = build(SubmodelSpec.full(RESNET20))
    kept = tuple(b for b in range(9) if b != skipped)
    sub = build(SubmodelSpec(RESNET20, blocks=kept), init=False)
    sub.load_state_dict({k: v for k, v in full.state_dict().items() if k in sub.state_dict()})
    with torch.no_grad():
        full.blocks[skipped].step.zero_()
    full.blocks[skipped].step.requires_grad_(False)
    full.train(), sub.train()
    x = torch.randn(4, 3, 16, 16)
    y = torch.tensor([0, 1, 2, 3])
    out_full, out_sub = full(x), sub(x)
    torch.testing.assert_close(out_full, out_sub, rtol=1e-5, atol=1e-6)
    torch.nn.functional.cross_entropy(out_full, y).backward()
    branch = full.blocks[skipped]
    for name in ("conv1", "conv2", "bn1", "bn2"):
        for p in getattr(branch, name).parameters():
            assert p.grad is not None and torch.count_nonzero(p.grad) == 0, name
    assert branch.step.grad is None


def test_preact_skipped_identity_block_is_the_identity_even_for_negative_inputs() -> None:
    net = build(SubmodelSpec(ModelConfig("preresnet20", image_size=16), blocks=(0, 2, 3, 4, 5, 6, 7, 8)))
    x = torch.randn(2, 16, 8, 8)
    assert torch.equal(net.blocks[1](x), x)


def test_vit_encoder_blocks_carry_two_step_sizes_and_skip_to_identity() -> None:
    model = ModelConfig("vit", image_size=16, extra={"dim": 32, "depth": 3, "heads": 4, "mlp_dim": 64})
    net = build(SubmodelSpec(model, width=0.5, blocks=(0, 2)))
    names = {n for n, _ in net.named_parameters()}
    assert {"blocks.0.step_sa", "blocks.0.step_ffn", "blocks.2.step_sa", "blocks.2.step_ffn"} <= names
    assert not any(n.startswith("blocks.1.") for n in names)
    assert net.blocks[0].heads == 2  # half of the 4 heads, head_dim kept
    x = torch.randn(2, 17, 32)
    assert torch.equal(net.blocks[1](x), x)
