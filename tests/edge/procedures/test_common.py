"""Shared procedure pieces: the distillation losses stay accurate when a bf16 model hands them bf16 logits.

Under `[train] precision = "bf16"` the whole local procedure runs in autocast, so every exit's logits come out
in bfloat16. A distillation gradient is the student's probabilities minus the teacher's; when the two nearly
agree (exits or models that have learnt the same thing) that difference is lost if both are rounded to bf16
first. `common.log_probs` / `common.probs` compute the softmaxes in float32, and every method's KD loss uses
them. The check: the gradient reaching the logits under bf16 autocast matches the float32 gradient of the same
logits up to bf16's own rounding of that gradient (2^-8), not ~10-20 % off as it was.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from nestling.edge.procedures.common import log_probs, probs
from nestling.edge.procedures.depthwise import mutual_loss
from nestling.edge.procedures.distill import depthfl_loss, scalefl_loss
from nestling.edge.procedures.fjord import fjord_kd_loss
from nestling.task_params import FedepthParams

Y = torch.arange(32) % 10
KD = 1000.0  # a distillation weight that makes the KD term dominate the (float32) cross-entropies


def nearly_agreeing_logits(count: int) -> list[torch.Tensor]:
    """Logits of `count` exits (or models) that agree to ~0.02, rounded to bf16 as a bf16 forward gives them."""
    generator = torch.Generator().manual_seed(0)
    base = 3 * torch.randn(32, 10, generator=generator)
    return [(base + 0.02 * torch.randn(32, 10, generator=generator)).bfloat16() for _ in range(count)]


def gradient_error_under_bf16(loss_of: Callable[[list[torch.Tensor]], torch.Tensor], count: int) -> float:
    """Relative error of the logits' gradient: bf16 logits under bf16 autocast vs the same values in float32."""
    logits = nearly_agreeing_logits(count)
    grads = {}
    for bf16 in (True, False):
        leaves = [(z.clone() if bf16 else z.float()).requires_grad_(True) for z in logits]
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False, enabled=bf16):
            loss = loss_of(leaves)
        loss.backward()
        grads[bf16] = torch.cat([leaf.grad.float().flatten() for leaf in leaves if leaf.grad is not None])
    return float((grads[True] - grads[False]).norm() / grads[False].norm())


LOSSES: dict[str, tuple[Callable[[list[torch.Tensor]], torch.Tensor], int]] = {
    "depthfl": (lambda z: depthfl_loss(z, Y, kd_weight=KD), 3),
    "scalefl": (lambda z: scalefl_loss(z, Y, kd_active=True, gamma=KD, temperature=3.0), 3),
    "m-fedepth": (lambda z: mutual_loss(z, Y, FedepthParams(kd_weight=KD))[0], 2),
    "fjord": (lambda z: fjord_kd_loss(z[0], z[1]), 2),
}


@pytest.mark.parametrize("method", list(LOSSES))
def test_distillation_gradients_under_bf16_match_float32_up_to_bf16_rounding(method: str) -> None:
    loss_of, count = LOSSES[method]
    # Measured: 0.0017-0.0028 with float32 softmaxes; 0.14-0.33 when softmax ran on the bf16 logits.
    assert gradient_error_under_bf16(loss_of, count) < 0.01


def test_the_softmaxes_are_float32_and_equal_the_plain_ones_on_float32_logits() -> None:
    z = nearly_agreeing_logits(1)[0].float()
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        assert log_probs(z.bfloat16()).dtype == probs(z.bfloat16(), 3.0).dtype == torch.float32
    # Outside autocast and on float32 logits they are exactly the usual softmaxes: fp32 runs do not change.
    assert torch.equal(log_probs(z), F.log_softmax(z, dim=1))
    assert torch.equal(probs(z, 3.0), F.softmax(z / 3.0, dim=1))
