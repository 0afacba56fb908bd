"""`fjord`: ordered dropout — a width p ≤ p_max per mini-batch with ⌈C·p⌉ channels and per-width BN (METHODS §7.2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nestling.edge.procedures import ClientData, DeviceStore, get_procedure
from nestling.edge.procedures.fjord import widths_up_to
from nestling.models import ModelConfig, build, kept_channels, set_active_width
from nestling.models.layers import SlimConv2d
from nestling.spec import SubmodelSpec
from nestling.task_params import FjordParams

LEVELS = (0.2, 0.4, 0.6, 0.8, 1.0)
MODEL = ModelConfig("resnet20", num_classes=4, image_size=8, norm_stats="per_width", width_levels=LEVELS)


def data(n: int = 16) -> ClientData:
    generator = torch.Generator().manual_seed(0)
    return ClientData(torch.randn(n, 3, 8, 8, generator=generator), torch.arange(n) % 4)


def test_widths_up_to_never_exceeds_p_max() -> None:
    assert widths_up_to(0.6, list(LEVELS)) == [0.2, 0.4, 0.6]
    assert widths_up_to(1.0, list(LEVELS)) == list(LEVELS)
    with pytest.raises(ValueError, match="no FjORD width level"):
        widths_up_to(0.1, list(LEVELS))


@pytest.mark.parametrize("p", LEVELS)
def test_width_p_runs_exactly_ceil_c_p_channels_in_every_conv(p: float) -> None:
    net = build(SubmodelSpec.full(MODEL))
    seen: list[tuple[int, int]] = []
    for module in net.modules():
        if isinstance(module, SlimConv2d):
            module.register_forward_hook(
                lambda m, i, o: seen.append((o.shape[1], kept_channels(m.global_out, p)))
            )
    set_active_width(net, p)
    net.eval()
    assert net(torch.randn(2, 3, 8, 8)).shape == (2, 4)  # every class row kept
    assert seen and all(got == want for got, want in seen)


def test_sampling_stays_within_the_tier_and_each_width_moves_only_its_own_bn_statistics() -> None:
    p_max = 0.6
    torch.manual_seed(0)
    net = build(SubmodelSpec(MODEL, width=p_max))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    widths_run: list[int] = []
    conv = net.blocks[0].conv1
    conv.register_forward_hook(lambda m, i, o: widths_run.append(o.shape[1]))
    hp = {"p_max": p_max, "widths": list(LEVELS), "lr": 0.05, "batch_size": 4, "local_steps": 30}
    outcome = get_procedure("fjord")(
        net, data(), FjordParams.from_hparams(hp), DeviceStore(), torch.Generator().manual_seed(1)
    )
    sampled = outcome.extra["sampled_widths"]
    assert len(sampled) == 30 and set(sampled) <= {0.2, 0.4, 0.6}
    assert len(set(sampled)) > 1  # more than one width is actually drawn
    assert widths_run == [kept_channels(16, p) for p in sampled]
    state = net.state_dict()
    assert not any(k.endswith(("_w3", "_w4")) for k in state)  # no statistics for widths above p_max
    for j, level in enumerate((0.2, 0.4, 0.6)):
        moved = not torch.equal(
            state[f"blocks.0.bn1.running_mean_w{j}"], before[f"blocks.0.bn1.running_mean_w{j}"]
        )
        assert moved == (level in sampled)
    assert all(
        conv.active_out is None for conv in net.modules() if isinstance(conv, SlimConv2d)
    )  # width reset


def test_self_distillation_teacher_learns_only_from_its_own_cross_entropy() -> None:
    """One step with kd: grad = ∇CE(teacher at p_max, y) + ∇CE(student at p, softmax(teacher).detach())."""
    p_max = 0.8
    torch.manual_seed(0)
    net = build(SubmodelSpec(MODEL, width=p_max))
    start = {k: v.clone() for k, v in net.state_dict().items()}
    d = data(8)
    hp = {
        "p_max": p_max,
        "widths": list(LEVELS),
        "lr": 0.1,
        "batch_size": 8,
        "local_steps": 1,
        "fjord_kd": True,
    }
    generator = torch.Generator().manual_seed(5)
    outcome = get_procedure("fjord")(net, d, FjordParams.from_hparams(hp), DeviceStore(), generator)
    (p,) = outcome.extra["sampled_widths"]
    if p == p_max:
        pytest.skip("seed drew p_max: no distillation step to check")
    reference = build(SubmodelSpec(MODEL, width=p_max), init=False)
    reference.load_state_dict(start)
    reference.train()
    params = [q for q in reference.parameters() if q.requires_grad]
    set_active_width(reference, p_max)
    teacher = reference(d.x)
    set_active_width(reference, p)
    student = reference(d.x)
    soft = F.softmax(teacher.detach(), dim=1)
    loss = F.cross_entropy(teacher, d.y) + torch.sum(-soft * F.log_softmax(student, dim=1), dim=1).mean()
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    trained = dict(net.named_parameters())
    for (name, q), g in zip([(n, q) for n, q in reference.named_parameters() if q.requires_grad], grads):
        expected = q.detach() - 0.1 * (g if g is not None else torch.zeros_like(q))
        torch.testing.assert_close(trained[name].detach(), expected, rtol=1e-4, atol=1e-5, msg=name)


def test_the_distillation_step_honours_grad_clip() -> None:
    """Both backward passes' gradients are clipped together to `grad_clip` before the step (as plain steps are):
    with momentum and weight decay off, every step moves the weights by at most lr·clip in norm."""
    p_max, lr, clip = 0.8, 0.1, 1e-3
    torch.manual_seed(0)
    net = build(SubmodelSpec(MODEL, width=p_max))
    moves: list[float] = []
    last = [q.detach().clone() for q in net.parameters()]

    def measure(module: torch.nn.Module, args: tuple) -> None:
        now = [q.detach().clone() for q in net.parameters()]
        moves.append(float(torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(now, last)))))
        last[:] = now

    hook = net.register_forward_pre_hook(measure)  # runs before each forward: the previous step's move
    hp = {"p_max": p_max, "widths": list(LEVELS), "lr": lr, "batch_size": 8, "local_steps": 12}
    outcome = get_procedure("fjord")(
        net,
        data(),
        FjordParams.from_hparams({**hp, "fjord_kd": True, "grad_clip": clip}),
        DeviceStore(),
        torch.Generator().manual_seed(3),
    )
    hook.remove()
    measure(net, ())
    assert any(p < p_max for p in outcome.extra["sampled_widths"])  # distillation steps did run
    steps = [m for m in moves if m > 0]  # the teacher's and student's forwards of one step see one move
    assert len(steps) == 12 and max(steps) <= lr * clip * (1 + 1e-3)
