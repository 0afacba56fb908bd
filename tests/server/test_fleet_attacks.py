"""One bad board against a fleet on the real mosquitto broker (issue 16): its updates are refused or undone,
the run finishes, and the global model stays where the honest boards take it."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from nestling.messages import Result, Task
from nestling.server.broker import EmbeddedBroker
from nestling.server.screening import RobustPolicy, largest_magnitude
from nestling.wire.client import connect_and_wait, make_client
from nestling.wire.codec import encode_message
from nestling.wire.fleet_messages import DeviceStatus, encode_hello, encode_result, encode_status
from nestling.wire.topics import QOS, FleetTopics
from tests.server.fleet_harness import wait_until
from tests.server.robust_harness import (
    fleet_server,
    honest,
    huge_values,
    inflated_samples,
    largest_difference,
    lying_samples,
    play_round,
    run_fleet,
    scaled,
)


@pytest.fixture(scope="module")
def broker():
    with EmbeddedBroker() as running:
        yield running


@pytest.fixture(scope="module")
def honest_run(broker):
    return run_fleet(broker, "honest", rounds=3, behaviours={})


@pytest.mark.parametrize("name, attack", [("huge", huge_values), ("scaled", scaled(100.0))])
def test_one_attacker_is_refused_and_the_model_stays_near_the_honest_run(broker, honest_run, name, attack):
    # A refused board may still send a corrected result, so its round waits for the deadline: keep it short.
    attacked = run_fleet(broker, f"attack-{name}", rounds=3, behaviours={2: attack}, deadline_s=2.0)
    assert all(r.aggregated and r.accepted == 2 for r in attacked.records)  # the run finished, every round
    assert sum(r.counters.get("rejected_update_norm", 0) for r in attacked.records) == 3
    assert math.isfinite(largest_magnitude(attacked.state))
    assert largest_difference(attacked.state, honest_run.state) < 0.1  # honest updates are ~0.01 per element


def statistics_lie(task: Task, board: int) -> Result:
    """Honest weights; every BN running variance x3.9 and every running mean +2.9 of its standard deviations:
    inside every bound an honest round needs (x4, 3 sigma), and through a mean, enough to take a model to chance."""
    result = honest(task, board)
    weights = dict(result.weights)
    for key, value in result.weights.items():
        if key.endswith("running_var"):
            mean = key.removesuffix("running_var") + "running_mean"
            weights[mean] = result.weights[mean] + 2.9 * value.clamp_min(0).sqrt()
            weights[key] = value * 3.9
    result.weights = weights
    return result


def _statistics_moved(state: dict[str, torch.Tensor], honest_state: dict[str, torch.Tensor]) -> float:
    return max(float((state[k] - honest_state[k]).abs().max()) for k in state if "running_" in k)


def test_in_range_bn_statistics_lies_do_not_move_the_fleets_model(broker, honest_run):
    """Through the real server: one board of three sends BN statistics inside every bound. With the default
    per-channel median ([run] bn_statistics) they are taken and move the model's statistics no further than
    honest noise does; through the papers' mean they move them by most of the lie."""
    attacked = run_fleet(broker, "bn-lie", rounds=3, behaviours={2: statistics_lie})
    assert all(r.aggregated and r.accepted == 3 for r in attacked.records)
    assert _statistics_moved(attacked.state, honest_run.state) < 0.1  # honest updates are ~0.01 per element
    averaged = run_fleet(
        broker,
        "bn-lie-mean",
        rounds=3,
        behaviours={2: statistics_lie},
        robust=RobustPolicy(bn_statistics="mean"),
    )
    assert all(
        r.aggregated and r.accepted == 3 for r in averaged.records
    )  # inside the cohort screen's bounds
    assert _statistics_moved(averaged.state, honest_run.state) > 0.5


def test_num_samples_above_the_hello_is_refused(broker):
    attacked = run_fleet(broker, "inflated", rounds=1, behaviours={2: inflated_samples}, deadline_s=3.0)
    record = attacked.records[0]
    assert record.counters["rejected_num_samples"] == 1 and record.accepted == 2
    assert largest_magnitude(attacked.state) > 0.1  # the all-zero weights did not take over


def test_a_divergence_let_through_is_rolled_back_and_its_devices_quarantined(broker):
    no_screening = RobustPolicy(screen_updates=False, quarantine_rounds=1)
    with fleet_server(broker, "diverge", 3, 3, no_screening) as (coordinator, _, devices):
        play_round(coordinator, devices, 0, {})
        good = {k: v.clone() for k, v in coordinator.strategy.global_state.items()}
        poisoned = play_round(coordinator, devices, 1, {2: huge_values})
        assert not poisoned.aggregated and poisoned.rolled_back == 1
        assert poisoned.quarantined == ["board-0", "board-1", "board-2"]
        assert largest_difference(coordinator.strategy.global_state, good) == 0.0
        assert coordinator.quarantine_log == [{"round": 1, "devices": poisoned.quarantined, "until_round": 3}]


def test_next_round_mostly_non_finite_rolls_the_previous_round_back(broker):
    policy = RobustPolicy(quarantine_rounds=0)
    with fleet_server(broker, "nan-next", 3, 3, policy, deadline_s=3.0) as (coordinator, _, devices):
        play_round(coordinator, devices, 0, {})
        good = {k: v.clone() for k, v in coordinator.strategy.global_state.items()}
        play_round(coordinator, devices, 1, {})

        def nan(task, board):
            result = honest(task, board)
            result.weights = {
                k: torch.full_like(v, float("nan")) if v.is_floating_point() else v
                for k, v in result.weights.items()
            }
            return result

        record = play_round(coordinator, devices, 2, {0: nan, 1: nan})
        assert record.rolled_back == 1 and not record.aggregated
        assert largest_difference(coordinator.strategy.global_state, good) == 0.0


def test_a_corrected_result_after_a_refused_one_is_accepted(broker):
    with fleet_server(broker, "corrected", 2, 1) as (coordinator, _, devices), ThreadPoolExecutor(1) as pool:
        running = pool.submit(coordinator.run_round, 0)
        task0, session0 = devices[0].next_task()
        task1, session1 = devices[1].next_task()
        devices[0].send_result(inflated_samples(task0, 0), session0)
        devices[0].send_result(honest(task0, 0), session0)
        # board 1 answers once the correction is in: the two boards' frames travel on separate connections,
        # and a round whose boards have all answered closes (a refused result is its board's answer)
        wait_until(
            lambda: task0.task_id in coordinator.admission.seen_tasks,
            30,
            "the corrected result to be admitted",
        )
        devices[1].send_result(honest(task1, 1), session1)
        record = running.result(timeout=60)
    assert record.counters["rejected_num_samples"] == 1 and record.accepted == 2 and record.aggregated


def test_retained_garbage_is_ignored_and_cleared_when_the_server_starts(broker):
    fleet = "retained"
    topics = FleetTopics(fleet)
    planter = make_client("planter")
    connect_and_wait(planter, broker.host, broker.port)
    garbage = Result(
        round=0,
        device_id="board-0",
        task_id="r0-board-0",
        spec_id="0" * 12,
        weights={"x": torch.full((4,), 3.0e38)},
        num_samples=10**9,
    )
    planter.publish(
        topics.result("board-0"), encode_result(garbage, "old-session"), qos=QOS, retain=True
    ).wait_for_publish(5)
    planter.publish(
        topics.hello("ghost"), encode_hello("ghost", {"num_samples": 10**8}), qos=QOS, retain=True
    ).wait_for_publish(5)
    planter.disconnect()
    with fleet_server(broker, fleet, 2, 1) as (coordinator, transport, devices):
        wait_until(
            lambda: transport.counters["ignored_retained"] >= 2, 10, "the retained frames to be ignored"
        )
        assert "ghost" not in {d.device_id for d in transport.devices()}
        record = play_round(coordinator, devices, 0, {})
        assert record.aggregated and record.accepted == 2
    with fleet_server(broker, fleet, 2, 1) as (_, transport, _):  # cleared: a second server sees nothing
        assert transport.counters["ignored_retained"] == 0


def test_extreme_numbers_in_every_field_are_refused_and_the_round_goes_on(broker):
    fleet = "extremes"
    topics = FleetTopics(fleet)
    with fleet_server(broker, fleet, 2, 1) as (coordinator, transport, devices):
        attacker = make_client("extremes-attacker")
        connect_and_wait(attacker, broker.host, broker.port)
        frames = []
        for value in (10**400, -(10**400), 2**64, -1, 10**18):
            for field in ("num_samples", "index", "memory_budget_bytes"):
                frames.append(
                    (topics.hello("board-1"), encode_hello("board-1", {"num_samples": 5, field: value}))
                )
            frames.append(
                (
                    topics.status("board-1"),
                    encode_message(
                        "status",
                        {
                            "device_id": "board-1",
                            "round": None,
                            "meta": {"state": "online", "resources": {"big": value}},
                        },
                    ).replace(b'"round":null', f'"round":{value}'.encode()),
                )
            )
        for topic, payload in frames:
            attacker.publish(topic, payload, qos=QOS).wait_for_publish(5)
        attacker.publish(
            topics.status("board-1"), encode_status(DeviceStatus("board-1", "online", 0, {})), qos=QOS
        ).wait_for_publish(5)

        def refused() -> int:
            transport.devices()  # the transport handles its inbox on the coordinator's calls
            return sum(v for k, v in transport.counters.items() if k.startswith("rejected_"))

        wait_until(lambda: refused() >= 20, 20, "the extreme frames to be refused")
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(coordinator.run_round, 0)
            for number, device in enumerate(devices):
                task, session = device.next_task()
                if number == 1:
                    for value in (10**400, 2**64, 10**18):
                        raw = encode_result(honest(task, 1), session).replace(
                            b'"num_samples":10', f'"num_samples":{value}'.encode()
                        )
                        device.publish("result", raw)
                device.send_result(honest(task, number), session)
            record = running.result(timeout=60)
        attacker.disconnect()
    assert record.aggregated and record.accepted == 2
    assert transport.counters["rejected_internal_error"] == 0


def agreeing(task, board):
    """Honest boards whose updates share a direction (as real local SGD on related data does): a common step
    plus each board's own noise."""
    result = honest(task, board)
    for value in result.weights.values():
        if value.is_floating_point():
            value.add_(0.02 * torch.ones_like(value))
    return result


def sign_flipped_agreeing(task, board):
    result = agreeing(task, board)
    for key, value in result.weights.items():
        if value.is_floating_point():
            base = task.weights[key]
            value.copy_(base - (value - base))
    return result


def test_a_sign_flipped_board_is_refused_on_direction(broker):
    """Its update has an honest norm, so only its direction gives it away; the four honest boards stay in.
    The direction screen is opt-in (issue 29: honest non-IID boards can point against the others)."""
    behaviours = {board: agreeing for board in range(5)}
    robust = RobustPolicy(min_update_cosine=0.0)
    clean = run_fleet(
        broker, "agree-clean", rounds=2, behaviours=behaviours, boards=5, deadline_s=3.0, robust=robust
    )
    assert all(r.counters.get("rejected_update_direction", 0) == 0 for r in clean.records)
    attacked = run_fleet(
        broker,
        "agree-flip",
        rounds=2,
        behaviours={**behaviours, 4: sign_flipped_agreeing},
        boards=5,
        deadline_s=3.0,
        robust=robust,
    )
    assert [r.counters.get("rejected_update_direction", 0) for r in attacked.records] == [1, 1]
    assert all(r.aggregated and r.accepted == 4 for r in attacked.records)
    # The honest boards step every weight by +0.02 a round; let through, the flipped board would pull the mean
    # step to (4 - 1) x 0.02 / 5 = 0.012, i.e. 0.016 lower after two rounds. Refused, the model moves as with
    # five honest boards (their noise averages out over the elements).
    shift = [
        (attacked.state[k] - clean.state[k]).double().mean()
        for k in clean.state
        if clean.state[k].is_floating_point()
    ]
    assert abs(float(torch.stack(shift).mean())) < 0.004


def _nan_weights(task, board):
    result = honest(task, board)
    result.weights = {
        k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in result.weights.items()
    }
    return result


@pytest.mark.parametrize(
    ("behaviour", "counter"),
    [(inflated_samples, "rejected_num_samples"), (_nan_weights, "rejected_non_finite")],
)
def test_a_round_whose_boards_all_answered_closes_at_once_though_one_answer_was_refused(
    broker, behaviour, counter
):
    """A refused result (by the coordinator, or at the transport) is its board's answer: no 300 s wait."""
    attacked = run_fleet(broker, f"answered-{counter}", rounds=1, behaviours={2: behaviour}, deadline_s=300.0)
    record = attacked.records[0]
    assert record.counters[counter] == 1 and record.accepted == 2 and record.aggregated
    assert record.closed_at - record.dispatched_at < 30.0


def test_a_consistent_sample_lie_weighs_three_boards_not_the_fleet(broker, caplog):
    """Hello and every result claim 10**9 samples (issue 25: it took FedAvg over). Nothing is refused (the result
    matches its hello), but the claim counts at most 3 x the fleet's median registered count (100) and at most
    half of a round of four (whose honest results say 10 samples each): the liar weighs 30 samples of 60."""
    with caplog.at_level("INFO", logger="nestling.coordinator"):
        lie = run_fleet(
            broker, "lie", rounds=1, behaviours={0: lying_samples}, boards=4, hello_samples={0: 10**9}
        )
    (record,) = lie.records
    assert record.counters.get("bounded_num_samples") == 1 and record.accepted == 4 and record.aggregated
    assert "weight bounded to 30 samples: claims 1000000000 samples" in caplog.text
