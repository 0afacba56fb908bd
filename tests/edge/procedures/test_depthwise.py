"""`fedepth`: depth-wise stages with true freezing, the parameter-free link, partial training and m-FeDepth
(METHODS §3.a.3–3.a.8, invariants §3.b 2–6)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from nestling.edge.procedures import ClientData, DeviceStore, get_procedure
from nestling.edge.procedures.depthwise import AUX_KEY, fresh_auxiliary, mutual_loss, run_stages, skip_link
from nestling.errors import ConfigError
from nestling.models import ModelConfig, build
from nestling.models.net import ScalableNet
from nestling.profiler.decompose import StagePlan
from nestling.spec import SubmodelSpec
from nestling.task_params import FedepthParams

torch.set_num_threads(1)

MODEL = ModelConfig("preresnet20", num_classes=4, image_size=8, norm_stats="batch")
HP = FedepthParams(lr=0.05, momentum=0.9, weight_decay=5e-4, batch_size=8, local_steps=3)
THREE_STAGES = StagePlan(((0, 1), (2, 3, 4), (5, 6, 7, 8)))


def data(n: int = 24) -> ClientData:
    generator = torch.Generator().manual_seed(1)
    y = torch.arange(n) % 4
    return ClientData(torch.randn(n, 3, 8, 8, generator=generator) + y.view(-1, 1, 1, 1).float(), y)


def network(model: ModelConfig = MODEL, **spec: Any) -> ScalableNet:
    torch.manual_seed(0)
    return build(SubmodelSpec(model, **spec))


def snapshot(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def fedepth(net: ScalableNet, plan: StagePlan, store: DeviceStore | None = None, **hp: Any):
    return get_procedure("fedepth")(
        net,
        data(),
        replace(HP, plan=plan.to_dict(), **hp),
        store if store is not None else DeviceStore(),
        torch.Generator().manual_seed(5),
    )


def trained_prefixes(plan: StagePlan, j: int, *, head: str = "head.") -> tuple[str, ...]:
    return tuple(f"blocks.{b}." for b in plan.stages[j]) + (head,) + (("stem.",) if j == 0 else ())


def test_the_link_is_parameter_free_zero_outside_its_centre_and_a_strided_sample_inside() -> None:
    z = torch.randn(2, 16, 32, 32)
    out = skip_link(z, 4, 64)
    assert out.shape == (2, 64, 8, 8)
    assert torch.equal(out[:, 24:40], z[:, :, ::4, ::4])  # pad 24 | 16 | 24 (METHODS §3.a.3)
    assert not out[:, :24].any() and not out[:, 40:].any()
    odd = skip_link(torch.randn(1, 3, 4, 4), 2, 8)
    assert (
        torch.equal(odd[:, 2:5], skip_link(odd[:, 2:5], 1, 3))
        and not odd[:, :2].any()
        and not odd[:, 5:].any()
    )
    tokens = torch.randn(2, 5, 7)
    assert skip_link(tokens, 4, 64) is tokens  # ViT stages already have the head's shape


def test_each_stage_changes_only_its_blocks_the_head_and_the_stem_in_stage_one() -> None:
    """Invariant 2, with momentum and weight decay on: frozen tensors bit-for-bit, their gradients None."""
    net = network()
    before = {"stage": -1, "state": snapshot(net)}
    last = snapshot(net)
    seen = []

    def observe(j: int, meter: Any, optimizer: torch.optim.Optimizer, params: list) -> None:
        nonlocal last
        if j != before["stage"]:
            before.update(stage=j, state=last)
        state = snapshot(net)
        allowed = trained_prefixes(THREE_STAGES, j)
        for key, value in state.items():
            if not key.startswith(allowed):
                assert torch.equal(value, before["state"][key]), (j, key)
        frozen = [p for n, p in net.named_parameters() if not n.startswith(allowed)]
        assert all(p.grad is None for p in frozen) and all(p.grad is not None for p in params)
        assert {id(p) for p in optimizer.state} <= {id(p) for p in params}  # no momentum for frozen tensors
        changed = [k for k in state if not torch.equal(state[k], before["state"][k])]
        assert any(k.startswith(f"blocks.{THREE_STAGES.stages[j][0]}.") for k in changed)
        seen.append(j)
        last = state

    run_stages([net], THREE_STAGES, data(), HP, torch.Generator().manual_seed(0), observe)
    assert seen == [0] * 3 + [1] * 3 + [2] * 3  # every stage gets the full local budget
    assert all(p.requires_grad for p in net.parameters())  # flags restored for the upload


def test_the_head_keeps_its_momentum_across_stages_while_new_blocks_start_fresh() -> None:
    """§3.a.4: stage j starts from (θ_j^t, φ_{j−1}^{t+1}); a fresh optimizer for the trainable set otherwise."""
    net = network()
    checked = []

    def observe(j: int, meter: Any, optimizer: torch.optim.Optimizer, params: list) -> None:
        if j != 1 or checked:
            return
        # After one step of a fresh buffer, buf = grad + wd·w_before where w_before = w + lr·buf.
        for p, fresh in ((net.blocks[2].conv1.weight, True), (net.head.fc.weight, False)):
            buf = optimizer.state[p]["momentum_buffer"]
            w_before = p.detach() + HP.lr * buf
            assert torch.allclose(buf, p.grad + HP.weight_decay * w_before, atol=1e-6) == fresh
        checked.append(j)

    run_stages([net], THREE_STAGES, data(), HP, torch.Generator().manual_seed(0), observe)
    assert checked == [1]


def test_a_single_stage_is_exactly_plain_local_training() -> None:
    """Invariant 4: a client with r = 1 performs FedAvg's local update."""
    a, b = network(), network()
    fedepth(a, StagePlan((tuple(range(9)),)))
    get_procedure("sgd")(b, data(), HP, DeviceStore(), torch.Generator().manual_seed(5))
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key


def test_bypassed_blocks_are_unchanged_in_the_upload_and_can_be_left_out() -> None:
    """Invariant 5; a shape-changing bypassed block (B4) is crossed by the parameter-free link."""
    net = network()
    initial = snapshot(net)
    plan = StagePlan(((), (4,), (5, 6, 7, 8)), bypass=(0, 1, 2, 3))
    outcome = fedepth(net, plan)
    state = outcome.model.state_dict()
    for key, value in state.items():
        if key.startswith(tuple(f"blocks.{b}." for b in plan.bypass)):
            assert torch.equal(value, initial[key]), key
    assert not torch.equal(
        state["stem.conv.weight"], initial["stem.conv.weight"]
    )  # the stem-only stage trained it
    assert outcome.extra == {"stages": 3, "bypassed": 4, "models": 1} and not outcome.untouched
    left_out = fedepth(network(), plan, aggregate_bypassed=False).untouched
    assert left_out == {
        k for k in state if k.startswith(("blocks.0.", "blocks.1.", "blocks.2.", "blocks.3."))
    }


def test_stages_ending_early_train_their_own_auxiliary_head_in_the_aux_variant() -> None:
    """§3.a.8: BN → GAP → linear after the stage's last block; the final head trains only in the last stage."""
    model = MODEL.with_(exit_points=tuple(range(8)), exit_kind="fedepth")
    net = network(model, exits=(1, 4))
    initial = snapshot(net)
    frozen_head_in_early_stages = []

    def observe(j: int, meter: Any, optimizer: torch.optim.Optimizer, params: list) -> None:
        if j < 2:
            frozen_head_in_early_stages.append(torch.equal(net.head.fc.weight, initial["head.fc.weight"]))

    run_stages(
        [net], THREE_STAGES, data(), replace(HP, variant="aux"), torch.Generator().manual_seed(0), observe
    )
    assert frozen_head_in_early_stages == [True] * 6
    final = net.state_dict()
    for key in ("exits.1.fc.weight", "exits.4.fc.weight", "head.fc.weight"):
        assert not torch.equal(final[key], initial[key]), key
    assert not hasattr(net.exits["1"], "relu") or net.exits["1"].relu is False


def test_split_stage_steps_share_the_local_budget() -> None:
    full = fedepth(network(), THREE_STAGES)
    split = fedepth(network(), THREE_STAGES, stage_steps="split", local_steps=6)
    assert (full.steps, split.steps) == (9, 6)


def test_mutual_loss_has_no_distillation_term_between_identical_models() -> None:
    """Invariant 6 (first half): identical logits → the loss is the sum of the cross-entropies."""
    logits = torch.randn(6, 4)
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    total, first = mutual_loss([logits, logits.clone()], y, FedepthParams())
    assert torch.allclose(total, 2 * F.cross_entropy(logits, y)) and torch.allclose(
        first, F.cross_entropy(logits, y)
    )
    different, _ = mutual_loss([logits, torch.randn(6, 4)], y, FedepthParams())
    single, _ = mutual_loss([logits], y, FedepthParams())
    assert torch.allclose(single, F.cross_entropy(logits, y))
    assert different > F.cross_entropy(logits, y)


def trained_looking() -> ScalableNet:
    """A downloaded global model: norm affines and biases away from their initial values."""
    net = network()
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "bn" in name or "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return net


INITIAL = {"model": MODEL.to_dict(), "seed": 0}  # network() builds the initial model under this seed


def test_the_auxiliary_model_persists_on_the_device_and_only_model_one_is_uploaded() -> None:
    """Invariant 6 (second half)."""
    store = DeviceStore()
    net = trained_looking()
    outcome = fedepth(net, StagePlan((tuple(range(9)),)), store, models=2, initial_model=INITIAL)
    assert outcome.model is net and outcome.extra["models"] == 2
    aux = store[AUX_KEY.format(0)]
    fresh = fresh_auxiliary(network(), network().state_dict()).state_dict()
    assert not torch.equal(aux["blocks.0.conv1.weight"], fresh["blocks.0.conv1.weight"])  # it trained
    assert not torch.equal(aux["head.fc.weight"], net.state_dict()["head.fc.weight"])  # a different model
    # Next participation: the stored model is the starting point (lr 0 keeps it exactly).
    fedepth(network(), StagePlan((tuple(range(9)),)), store, models=2, lr=0.0, initial_model=INITIAL)
    for key, value in store[AUX_KEY.format(0)].items():
        assert torch.equal(value, aux[key]), key


def test_the_auxiliary_model_starts_as_the_initial_global_model_not_the_download() -> None:
    """§3.a.7: a client first sampled after round 0 downloads a trained model; its auxiliary peer is the run's
    initial model (rebuilt from the config and seed) with norm affines (1, 0) and zero linear biases, so the
    two models start apart and distil from each other from the first step. A copy of the download shared
    its convolutions: the distillation only saw the reset affines."""
    store = DeviceStore()
    downloaded = trained_looking()
    with torch.no_grad():  # what the federation learnt so far, in the convolutions too
        for p in downloaded.parameters():
            p.add_(0.1 * torch.randn_like(p))
    initial = network().state_dict()
    fedepth(downloaded, StagePlan((tuple(range(9)),)), store, models=2, lr=0.0, initial_model=INITIAL)
    aux = store[AUX_KEY.format(0)]
    for key, value in aux.items():
        if key.endswith(("bn1.weight", "bn2.weight", "bn.weight", "norm.weight")):
            assert torch.equal(value, torch.ones_like(value)), key
        elif key.endswith(("bn1.bias", "bn2.bias", "bn.bias", "norm.bias", "fc.bias")):
            assert not value.any(), key
        else:
            assert torch.equal(value, initial[key]), key  # the initial model's weights, not the download's
    x, y = data().x, data().y
    logits = [downloaded(x), fresh_auxiliary(downloaded, initial)(x)]
    total, _ = mutual_loss(logits, y, FedepthParams())
    distillation = total - F.cross_entropy(logits[0], y) - F.cross_entropy(logits[1], y)
    assert distillation > 0.01  # the first step already distils


def test_m_fedepth_without_the_initial_model_is_refused() -> None:
    with pytest.raises(ConfigError, match="initial_model"):
        fedepth(network(), StagePlan((tuple(range(9)),)), DeviceStore(), models=2)


def test_two_models_distil_depth_wise_too() -> None:
    store = DeviceStore()
    outcome = fedepth(network(), THREE_STAGES, store, models=2, initial_model=INITIAL)
    assert outcome.steps == 9 and AUX_KEY.format(0) in store
    assert all(torch.isfinite(torch.tensor(outcome.losses)))


def test_bad_plans_are_refused() -> None:
    with pytest.raises(Exception, match="disjoint"):
        fedepth(network(), StagePlan(((0, 1), (1, 2))))
    with pytest.raises(Exception, match="models >= 1"):
        fedepth(network(), THREE_STAGES, models=0)


def test_an_auxiliary_of_another_model_in_the_store_is_replaced_by_a_fresh_one(caplog) -> None:
    from nestling.edge.procedures.depthwise import AUX_KEY, load_auxiliaries
    from nestling.edge.procedures.registry import DeviceStore
    from nestling.models.config import ModelConfig
    from nestling.models.zoo import build
    from nestling.spec import SubmodelSpec

    small = build(SubmodelSpec(ModelConfig("tinycnn", in_channels=1, image_size=16)))
    other = build(SubmodelSpec(ModelConfig("tinycnn", in_channels=3, image_size=16)))
    store = DeviceStore({AUX_KEY.format(0): {k: v.clone() for k, v in other.state_dict().items()}})
    initial = {"model": ModelConfig("tinycnn", in_channels=1, image_size=16).to_dict(), "seed": 0}
    (peer,) = load_auxiliaries(small, store, 1, FedepthParams(initial_model=initial))
    assert all(peer.state_dict()[k].shape == v.shape for k, v in small.state_dict().items())
    assert "does not fit" in caplog.text


# METHODS §3.a.2's r = 1/8 plan: B1–B3 bypassed, stage 1 holds B4 alone (the bypassed prefix ends at a block
# that does not change the shape, so the stem's output reaches B4 through identities).
LACK_PAPER_PLAN = StagePlan(((3,), (4,), (5,), (6, 7), (8,)), bypass=(0, 1, 2))


def test_the_stem_trains_in_stage_one_after_a_bypassed_prefix() -> None:
    """§3.a.5: bypassed blocks are crossed by identities, and the stem still learns in stage 1. Running them
    without autograd cut the graph at the stem's output: no gradient reached the stem."""
    net = network()
    initial = snapshot(net)
    stem_grads: dict[int, list[bool]] = {}

    def observe(j: int, meter: Any, optimizer: torch.optim.Optimizer, params: list) -> None:
        grad = net.stem.conv.weight.grad
        stem_grads.setdefault(j, []).append(grad is not None and bool(grad.abs().sum() > 0))

    run_stages([net], LACK_PAPER_PLAN, data(), HP, torch.Generator().manual_seed(0), observe)
    assert stem_grads[0] == [True] * 3  # every step of stage 1 moves the stem
    assert all(not any(flags) for j, flags in stem_grads.items() if j > 0)  # and no later stage does
    final = net.state_dict()
    assert not torch.equal(final["stem.conv.weight"], initial["stem.conv.weight"])
    assert not torch.equal(final["stem.bn.weight"], initial["stem.bn.weight"])
    for key, value in final.items():
        if key.startswith(("blocks.0.", "blocks.1.", "blocks.2.")):
            assert torch.equal(value, initial[key]), key  # the bypassed blocks themselves never move


def test_a_vit_trains_its_patch_embedding_in_every_stage() -> None:
    """§3.a.9: every ViT stage trains the patch embedding, so its gradient crosses the frozen earlier blocks."""
    model = ModelConfig(
        "vit", num_classes=4, image_size=8, extra={"dim": 16, "depth": 4, "heads": 2, "mlp_dim": 32}
    )
    net = network(model)
    plan = StagePlan(((0, 1), (2, 3)))
    moved: list[tuple[int, bool]] = []
    last = snapshot(net)

    def observe(j: int, meter: Any, optimizer: torch.optim.Optimizer, params: list) -> None:
        nonlocal last
        state = snapshot(net)
        moved.append((j, not torch.equal(state["stem.proj.weight"], last["stem.proj.weight"])))
        if j == 1:  # the frozen blocks of stage 1 stay bit-for-bit
            frozen = [k for k in state if k.startswith(("blocks.0.", "blocks.1."))]
            assert frozen and all(torch.equal(state[k], last[k]) for k in frozen)
        last = state

    run_stages(
        [net], plan, data(), replace(HP, stem_every_stage=True), torch.Generator().manual_seed(0), observe
    )
    assert moved == [(0, True)] * 3 + [(1, True)] * 3
