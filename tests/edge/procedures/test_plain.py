"""`sgd`: plain local SGD with cross-entropy on the deepest output; shared batching and label-masked CE."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nestling.edge.procedures import ClientData, DeviceStore, get_procedure
from nestling.edge.procedures.common import batches, cross_entropy
from nestling.models import ModelConfig, build
from nestling.spec import SubmodelSpec
from nestling.task_params import TrainParams

MODEL = ModelConfig("tinycnn", num_classes=4, image_size=8)


def data(n: int = 24, seed: int = 0) -> ClientData:
    generator = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 4
    x = (
        torch.randn(n, 3, 8, 8, generator=generator) + y.view(-1, 1, 1, 1).float()
    )  # learnable: mean encodes class
    return ClientData(x, y)


def train(model_config: ModelConfig = MODEL, seed: int = 0, **hp) -> tuple[torch.nn.Module, list[float]]:
    torch.manual_seed(0)
    net = build(SubmodelSpec(model_config, width=0.5))
    outcome = get_procedure("sgd")(
        net,
        data(),
        TrainParams.from_hparams({"lr": 0.05, "batch_size": 8, "local_epochs": 1, **hp}),
        DeviceStore(),
        torch.Generator().manual_seed(seed),
    )
    return outcome.model, outcome.losses


def test_sgd_trains_and_lowers_the_loss() -> None:
    _, losses = train(local_epochs=8)
    assert len(losses) == 8 * 3
    assert sum(losses[-3:]) < sum(losses[:3])


def test_the_same_generator_seed_reproduces_the_same_weights() -> None:
    a, _ = train(seed=3)
    b, _ = train(seed=3)
    c, _ = train(seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), c.state_dict().values()))


def test_frozen_step_sizes_stay_at_their_initial_value() -> None:
    net, _ = train(MODEL.with_(learnable_step=False), local_epochs=2)
    steps = [v for k, v in net.state_dict().items() if k.endswith(".step")]
    assert steps and all(float(s) == 1.0 for s in steps)
    learnt, _ = train(local_epochs=2)
    assert any(float(v) != 1.0 for k, v in learnt.state_dict().items() if k.endswith(".step"))


def test_batches_honour_local_steps_and_skip_single_sample_batches() -> None:
    generator = torch.Generator().manual_seed(0)
    assert len(list(batches(data(24), TrainParams(batch_size=5, local_steps=7), generator))) == 7
    # 9 samples, batch 4: an epoch is ceil(9/4) = 3 steps; the lone ninth sample (which BatchNorm's batch
    # statistics cannot use) is skipped and the step comes from the next shuffle instead.
    sizes = [len(y) for _, y in batches(data(9), TrainParams(batch_size=4, local_epochs=1), generator)]
    assert sizes == [4, 4, 4]


def test_masked_cross_entropy_zeroes_logits_outside_the_label_set() -> None:
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5]])
    y = torch.tensor([0])
    masked = cross_entropy(logits, y, TrainParams(masked_ce=True, label_set=[0, 1]))
    expected = F.cross_entropy(torch.tensor([[2.0, -1.0, 0.0, 0.0]]), y)  # 0, not −∞ (METHODS §7.1)
    torch.testing.assert_close(masked, expected)
    assert torch.equal(cross_entropy(logits, y, TrainParams()), F.cross_entropy(logits, y))
