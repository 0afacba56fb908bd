"""Same-spec clients trained together give what sequential training gives, to float tolerance."""

from __future__ import annotations

import pytest
import torch

from nestling.edge.procedures import ClientData, DeviceStore
from nestling.edge.trainer import run_task
from nestling.errors import ConfigError
from nestling.messages import Task
from nestling.models.config import ModelConfig
from nestling.models.zoo import build
from nestling.simulator.backend import InProcessBackend, balanced_jobs, split_jobs
from nestling.simulator.batched import BatchPolicy, batch_key, run_tasks, train_batched
from nestling.spec import SubmodelSpec

MODEL = ModelConfig("tinycnn", num_classes=5, in_channels=3, image_size=8)


def client_data(seed: int, n: int = 24, augment: str = "none") -> ClientData:
    generator = torch.Generator().manual_seed(seed)
    return ClientData(
        torch.randn(n, 3, 8, 8, generator=generator), torch.randint(0, 5, (n,), generator=generator), augment
    )


def make_tasks(count: int, width: float = 1.0, procedure: str = "sgd", **hparams: object) -> list[Task]:
    spec = SubmodelSpec(MODEL, width=width)
    torch.manual_seed(0)
    weights = build(spec).state_dict()
    hp = {"lr": 0.05, "batch_size": 8, "local_epochs": 2, **hparams}
    return [
        Task(
            3,
            f"dev-{k:05d}",
            spec.to_dict(),
            {n: v.clone() for n, v in weights.items()},
            procedure,
            {**hp, "seed": 1000 + k},
            task_id=f"r3-dev-{k:05d}",
        )
        for k in range(count)
    ]


def assert_same_training(tasks: list[Task], datas: list[ClientData]) -> None:
    sequential = [run_task(t, d, DeviceStore()) for t, d in zip(tasks, datas)]
    batched = train_batched(tasks, datas)
    for one, many in zip(sequential, batched):
        assert (one.device_id, one.task_id, one.spec_id, one.num_samples) == (
            many.device_id,
            many.task_id,
            many.spec_id,
            many.num_samples,
        )
        assert list(one.weights) == list(many.weights)
        for key in one.weights:
            torch.testing.assert_close(many.weights[key], one.weights[key], rtol=1e-4, atol=1e-5, msg=key)
        assert many.metrics["steps"] == one.metrics["steps"]
        assert many.metrics["loss_mean"] == pytest.approx(one.metrics["loss_mean"], rel=1e-5)


class TestMatchesSequentialTraining:
    def test_plain_sgd_with_batchnorm_running_statistics(self) -> None:
        tasks = make_tasks(3)
        assert_same_training(tasks, [client_data(k) for k in range(3)])

    def test_momentum_weight_decay_clipping_and_masked_loss(self) -> None:
        tasks = make_tasks(3, width=0.5, momentum=0.9, weight_decay=5e-4, grad_clip=0.5, masked_ce=True)
        tasks[0].hparams["label_set"] = [0, 2, 4]
        assert_same_training(tasks, [client_data(k) for k in range(3)])

    def test_each_client_keeps_its_own_augmentation_and_data_order(self) -> None:
        tasks = make_tasks(2, local_steps=5)
        assert_same_training(tasks, [client_data(k, augment="cifar") for k in range(2)])

    def test_batchnorm_running_statistics_are_per_client(self) -> None:
        results = train_batched(make_tasks(2), [client_data(0), client_data(1)])
        key = "stem.bn.running_mean"
        assert not torch.equal(results[0].weights[key], results[1].weights[key])
        assert int(results[0].weights["stem.bn.num_batches_tracked"]) == results[0].metrics["steps"]


class TestGrouping:
    def test_only_same_spec_same_shape_sgd_tasks_share_a_key(self) -> None:
        plain, narrow = make_tasks(2), make_tasks(1, width=0.5)
        assert batch_key(plain[0], 24) == batch_key(plain[1], 24)
        assert batch_key(plain[0], 24) != batch_key(plain[0], 30)
        assert batch_key(plain[0], 24) != batch_key(narrow[0], 24)
        assert batch_key(make_tasks(1, procedure="fjord")[0], 24) is None

    def test_run_tasks_returns_results_in_task_order(self) -> None:
        tasks = [*make_tasks(2), *make_tasks(1, width=0.5)]
        tasks[2].device_id, tasks[2].task_id = "dev-00009", "r3-dev-00009"
        datas = {t.device_id: client_data(i) for i, t in enumerate(tasks)}
        results = run_tasks(tasks, datas.__getitem__, {}, "cpu", BatchPolicy("on"))
        assert [r.device_id for r in results] == [t.device_id for t in tasks]
        assert [r.metrics.get("batched_with") for r in results] == [2, 2, None]

    def test_pool_jobs_cut_each_group_across_workers(self) -> None:
        tasks = make_tasks(5)
        assert split_jobs(tasks, 2, BatchPolicy("off")) == [[0], [1], [2], [3], [4]]  # sizes unknown
        assert sorted(map(len, split_jobs(tasks, 2, BatchPolicy("off"), lambda _: 24))) == [2, 3]
        assert split_jobs(tasks, 2, BatchPolicy("on"), lambda _: 24) == [[0, 2, 4], [1, 3]]

    def test_without_batching_each_worker_gets_one_job_of_near_equal_predicted_cost(self) -> None:
        assert balanced_jobs([5.0, 1.0, 4.0, 2.0, 3.0], 2) in ([[0, 1, 3], [2, 4]], [[2, 4], [0, 1, 3]])
        assert balanced_jobs([1.0, 1.0], 4) == [[0], [1]]  # never an empty job
        big, small = make_tasks(1), make_tasks(2, width=0.25)
        for k, t in enumerate(small):
            t.device_id = f"dev-{k + 1:05d}"
        jobs = split_jobs([*big, *small], 2, BatchPolicy("off"), lambda _: 24)
        assert sorted(jobs) == [[0], [1, 2]]  # the full-width task alone, the two quarter-width ones together


class TestPolicy:
    def test_auto_times_both_ways_after_a_warm_up_then_keeps_the_faster(self) -> None:
        policy = BatchPolicy("auto")
        assert policy.batched("s") is False
        policy.record("s", False, samples=100, seconds=60.0)  # warm-up (compilation): not counted
        assert policy.batched("s") is False
        policy.record("s", False, samples=100, seconds=2.0)
        assert policy.batched("s") is True
        policy.record("s", True, samples=100, seconds=9.0)
        policy.record("s", True, samples=100, seconds=4.0)
        assert policy.batched("s") is False  # batching was slower here: never again for this spec
        policy.record("s", True, samples=100, seconds=0.1)  # decided: later timings change nothing
        assert policy.batched("s") is False

    def test_modes_are_validated(self) -> None:
        assert BatchPolicy("on").batched("x") and not BatchPolicy("off").batched("x")
        with pytest.raises(ConfigError, match="batching must be off, on or auto"):
            BatchPolicy("sometimes")

    def test_in_process_backend_with_auto_batching_trains_every_task(self) -> None:
        datas = {f"dev-{k:05d}": client_data(k) for k in range(3)}
        backend = InProcessBackend(datas.__getitem__, policy=BatchPolicy("auto"))
        batched_rounds = []
        for _ in range(4):  # two rounds each way (a warm-up and a timed one), then the faster way
            results = backend.run(make_tasks(3))
            assert len(results) == 3
            batched_rounds.append(results[0].metrics.get("batched_with") == 3)
        assert batched_rounds == [False, False, True, True]
        assert set(backend.policy.speed) == {(results[0].spec_id, False), (results[0].spec_id, True)}


@pytest.mark.slow
def test_compiled_client_training_matches_eager_training() -> None:
    tasks, datas = make_tasks(2, momentum=0.9), [client_data(0), client_data(1)]
    eager = run_tasks(
        tasks, {t.device_id: d for t, d in zip(tasks, datas)}.__getitem__, {}, "cpu", BatchPolicy()
    )
    compiled = run_tasks(
        tasks,
        {t.device_id: d for t, d in zip(tasks, datas)}.__getitem__,
        {},
        "cpu",
        BatchPolicy(compile=True),
    )
    for one, other in zip(eager, compiled):
        for key in one.weights:
            torch.testing.assert_close(other.weights[key], one.weights[key], rtol=1e-4, atol=1e-5, msg=key)
