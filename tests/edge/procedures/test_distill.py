"""Multi-exit procedures: DepthFL mutual distillation (METHODS §7.3) and ScaleFL self-distillation (§6.a.5)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nestling.edge.procedures import ClientData, DeviceStore, get_procedure
from nestling.edge.procedures.distill import (
    depthfl_kd_weight,
    depthfl_loss,
    scalefl_exit_weights,
    scalefl_loss,
)
from nestling.models import ModelConfig, build
from nestling.spec import SubmodelSpec
from nestling.task_params import DepthflParams, ScaleflParams


def logits(seed: int) -> torch.Tensor:
    return torch.randn(6, 5, generator=torch.Generator().manual_seed(seed)) * 2


Y = torch.tensor([0, 1, 2, 3, 4, 0])


# -- DepthFL ---------------------------------------------------------------------------------------
def test_depthfl_consistency_weight_ramps_from_e_minus_5_to_one_over_300_rounds() -> None:
    assert depthfl_kd_weight(0) == pytest.approx(math.exp(-5)) == pytest.approx(0.0067, abs=1e-4)
    assert depthfl_kd_weight(150) == pytest.approx(math.exp(-5 * 0.25))
    assert depthfl_kd_weight(300) == 1.0 and depthfl_kd_weight(1000) == 1.0
    assert depthfl_kd_weight(10, ramp_rounds=10) == 1.0
    ramp = [depthfl_kd_weight(t) for t in range(0, 301, 25)]
    assert ramp == sorted(ramp)


def test_depthfl_kd_term_vanishes_when_all_classifiers_agree() -> None:
    z = logits(0)
    outputs = [z.clone().requires_grad_(), z.clone().requires_grad_(), z.clone().requires_grad_()]
    with_kd, without = depthfl_loss(outputs, Y, 1.0, True), depthfl_loss(outputs, Y, 1.0, False)
    torch.testing.assert_close(with_kd, without, rtol=0, atol=1e-5)
    assert float(depthfl_loss([logits(0), logits(1)], Y, 1.0)) > float(
        depthfl_loss([logits(0), logits(1)], Y, 1.0, False)
    )


def test_depthfl_loss_is_ce_plus_mutual_kl_with_detached_targets() -> None:
    outputs = [logits(s).requires_grad_() for s in range(3)]
    w, d = 0.7, 3
    expected = sum(F.cross_entropy(z, Y) for z in outputs)
    for i in range(d):
        for j in range(d):
            if i != j:
                p_j = F.softmax(outputs[j].detach(), 1)
                expected = (
                    expected + w / (d - 1) * (p_j * (p_j.log() - F.log_softmax(outputs[i], 1))).sum(1).mean()
                )
    torch.testing.assert_close(depthfl_loss(outputs, Y, w), expected, rtol=1e-5, atol=1e-5)
    # Detached targets: the KD gradient reaching z_0 comes only from z_0 as a student.
    (g_kd,) = torch.autograd.grad(depthfl_loss(outputs, Y, w), [outputs[0]])
    student_only = F.cross_entropy(outputs[0], Y) + w / (d - 1) * sum(
        F.kl_div(
            F.log_softmax(outputs[0], 1), F.softmax(outputs[j].detach(), 1) + 1e-7, reduction="batchmean"
        )
        for j in (1, 2)
    )
    (g_ref,) = torch.autograd.grad(student_only, [outputs[0]])
    torch.testing.assert_close(g_kd, g_ref, rtol=1e-5, atol=1e-6)


# -- ScaleFL ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("j", [1, 2, 3, 4, 7])
def test_scalefl_exit_weights_are_i_over_j_j_plus_1_half_and_sum_to_one(j: int) -> None:
    weights = scalefl_exit_weights(j)
    assert len(weights) == j and sum(weights) == pytest.approx(1.0)
    assert weights == pytest.approx([(i + 1) / (j * (j + 1) / 2) for i in range(j)])


def test_scalefl_kd_term_is_zero_when_every_exit_outputs_the_same_logits() -> None:
    z = logits(0)
    outputs = [z.clone(), z.clone(), z.clone()]
    on = scalefl_loss(outputs, Y, kd_active=True, gamma=0.5, temperature=3.0)
    off = scalefl_loss(outputs, Y, kd_active=False, gamma=0.5, temperature=3.0)
    torch.testing.assert_close(on, off, rtol=0, atol=1e-6)
    torch.testing.assert_close(off, F.cross_entropy(z, Y))  # weights sum to 1


def test_scalefl_loss_matches_the_reference_code_form() -> None:
    outputs = [logits(s).requires_grad_() for s in range(3)]
    gamma, t = 0.5, 3.0
    weights = [1 / 6, 2 / 6, 3 / 6]
    teacher = F.softmax(outputs[-1] / t, 1)
    expected = weights[2] * F.cross_entropy(outputs[2], Y)
    for w, z in zip(weights[:2], outputs[:2]):
        # PyTorch KLDivLoss 'mean': averaged over batch *and* classes.
        kl = (teacher * (teacher.log() - F.log_softmax(z / t, 1))).mean()
        expected = expected + w * (F.cross_entropy(z, Y) + gamma * t * t * kl)
    loss = scalefl_loss(outputs, Y, kd_active=True, gamma=gamma, temperature=t)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    # The teacher is not detached: the KD term sends gradient into the last exit too.
    (g_on,) = torch.autograd.grad(loss, [outputs[2]])
    (g_off,) = torch.autograd.grad(
        scalefl_loss(outputs, Y, kd_active=False, gamma=gamma, temperature=t), [outputs[2]]
    )
    assert not torch.allclose(g_on, g_off)


def exit_model(learnable_step: bool = True) -> torch.nn.Module:
    model = ModelConfig(
        "resnet20",
        num_classes=5,
        image_size=8,
        exit_points=(2, 5),
        exit_kind="scalefl",
        scaler="always",
        norm_stats="batch",
        rounding="floor",
        learnable_step=learnable_step,
    )
    torch.manual_seed(0)
    return build(SubmodelSpec(model, width=0.5, depth=6, exits=(2, 5), head=False))


def data() -> ClientData:
    return ClientData(
        torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(0)), torch.arange(8) % 5
    )


@pytest.mark.parametrize(("round_index", "active"), [(0, False), (25, False), (26, True), (99, True)])
def test_scalefl_kd_switches_on_only_after_a_quarter_of_the_rounds(round_index: int, active: bool) -> None:
    hp = {"round": round_index, "total_rounds": 100, "kd_gamma": 0.1, "local_steps": 1, "batch_size": 8}
    outcome = get_procedure("scalefl-sd")(
        exit_model(), data(), ScaleflParams.from_hparams(hp), DeviceStore(), torch.Generator().manual_seed(0)
    )
    assert outcome.extra["kd_active"] is active


def test_scalefl_reports_parameters_that_received_no_gradient() -> None:
    hp = {"round": 0, "total_rounds": 4, "local_steps": 2, "batch_size": 8}
    outcome = get_procedure("scalefl-sd")(
        exit_model(learnable_step=False),
        data(),
        ScaleflParams.from_hparams(hp),
        DeviceStore(),
        torch.Generator().manual_seed(0),
    )
    assert outcome.untouched == {f"blocks.{b}.step" for b in range(6)}
    trained = get_procedure("scalefl-sd")(
        exit_model(), data(), ScaleflParams.from_hparams(hp), DeviceStore(), torch.Generator().manual_seed(0)
    )
    assert trained.untouched == set()


def kd_model() -> torch.nn.Module:
    model = ModelConfig("resnet20", num_classes=5, image_size=8, exit_points=(2, 5), exit_kind="depthfl")
    torch.manual_seed(0)
    return build(SubmodelSpec(model, depth=6, exits=(2, 5), head=False))


def expected_depthfl_step(
    net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, w: float, lr: float
) -> dict:
    """One plain SGD step on METHODS §7.3's loss, written out here: Σ_i CE(z_i, y) + w/(d−1) Σ_{j≠i}
    Σ_batch Σ_c p_j (log p_j − log p_i) / B, with p_j = softmax(z_j).detach() (+1e-7 inside the KL target)."""
    outputs = net(x)
    d, batch = len(outputs), x.shape[0]
    loss = sum(F.cross_entropy(z, y) for z in outputs)
    for i in range(d):
        log_p_i = F.log_softmax(outputs[i], dim=1)
        for j in range(d):
            if j != i:
                target = F.softmax(outputs[j].detach(), dim=1) + 1e-7
                loss = loss + w / (d - 1) * (target * (target.log() - log_p_i)).sum() / batch
    params = [p for p in net.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    names = [n for n, p in net.named_parameters() if p.requires_grad]
    return {n: (p - lr * g if g is not None else p).detach() for n, p, g in zip(names, params, grads)}


def test_depthfl_procedure_trains_on_the_round_ramped_kd_loss_and_honours_the_kd_switch() -> None:
    """The reported weight is the one the step used: the trained weights equal one SGD step on the loss with
    w_150 = e^(−5/4), and differ from the steps with w = 1 (no ramp) and with KD off."""
    d = data()  # one batch of all 8 samples: the batch mean does not depend on their order
    hp = {"round": 150, "kd_ramp_rounds": 300, "local_steps": 1, "batch_size": 8, "kd": True, "lr": 0.5}
    net = kd_model()
    outcome = get_procedure("depthfl-kd")(
        net, d, DepthflParams.from_hparams(hp), DeviceStore(), torch.Generator().manual_seed(0)
    )
    w = math.exp(-5 * 0.25)
    assert outcome.extra["kd_weight"] == pytest.approx(w)
    assert outcome.steps == 1 and all(math.isfinite(v) for v in outcome.losses)
    trained = {n: p.detach() for n, p in net.named_parameters()}
    for weight, same in ((w, True), (1.0, False), (0.0, False)):
        expected = expected_depthfl_step(kd_model().train(), d.x, d.y, weight, hp["lr"])
        close = all(torch.allclose(trained[n], v, rtol=1e-4, atol=1e-6) for n, v in expected.items())
        assert close == same, weight
    off = kd_model()
    get_procedure("depthfl-kd")(
        off,
        d,
        DepthflParams.from_hparams({**hp, "kd": False}),
        DeviceStore(),
        torch.Generator().manual_seed(0),
    )
    no_kd = expected_depthfl_step(kd_model().train(), d.x, d.y, 0.0, hp["lr"])
    assert all(torch.allclose(p.detach(), no_kd[n], rtol=1e-4, atol=1e-6) for n, p in off.named_parameters())
