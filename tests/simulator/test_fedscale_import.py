"""FedScale importer: exact capacities, FedScale's availability rule and pairing, hostile pickles."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest

from nestling.errors import ConfigError
from nestling.profiler.traces import load_traces
from nestling.simulator.fedscale_import import (
    export_fedscale_capacity,
    fedscale_capacity,
    import_fedscale,
    load_plain_pickle,
    traces_import_main,
)

# Shaped like FedScale's files; values chosen to include awkward floats (ms -> s is inexact for
# some of them) and the example entry quoted in public code (DEVICES.md §4).
CAPACITY = {
    1: {"computation": 162.0, "communication": 5648.109619499134},
    2: {"computation": 37.7, "communication": 13002.5},
    3: {"computation": 1.3e-3, "communication": 0.1},
    4: {"computation": 987.6543210987654, "communication": 250},
}
BEHAVE = {
    10: {"duration": 300, "inactive": [200, 900], "finish_time": 1000, "active": [100, 600], "model": "SM-A"},
    20: {"duration": 50, "inactive": [1200], "finish_time": 1000, "active": [-5], "model": "SM-B"},
}


def dump(path: Path, data: object) -> Path:
    with path.open("wb") as stream:
        pickle.dump(data, stream)
    return path


def fedscale_is_active(entry: dict[str, Any], t: float) -> bool:
    """FedScale's rule (ClientMetadata.is_active) without its stateful index walk."""
    norm = t % entry["finish_time"]
    return any(a <= norm <= b for a, b in zip(entry["active"], entry["inactive"], strict=True))


def test_capacities_round_trip_exactly(tmp_path: Path) -> None:
    traces = import_fedscale(dump(tmp_path / "client_device_capacity", CAPACITY))
    assert export_fedscale_capacity(traces) == CAPACITY
    for trace, (client, capacity) in zip(traces, CAPACITY.items(), strict=True):
        assert trace.device_id == str(client)
        assert fedscale_capacity(trace) == capacity


def test_capacities_survive_a_trace_file(tmp_path: Path) -> None:
    traces = import_fedscale(dump(tmp_path / "cap", CAPACITY))
    from nestling.profiler.traces import save_traces

    save_traces(traces, tmp_path / "fleet.jsonl")
    assert export_fedscale_capacity(load_traces(tmp_path / "fleet.jsonl")) == CAPACITY


def test_times_match_fedscale_completion_time(tmp_path: Path) -> None:
    (trace,) = import_fedscale(dump(tmp_path / "cap", {7: {"computation": 162.0, "communication": 5648.1}}))
    batch, steps, update_bytes = 20, 10, 1_234_567
    update_kbit = update_bytes / 1024.0 * 8.0  # FedScale's sys.getsizeof(...)/1024*8
    assert trace.compute_seconds(0.0, model="resnet20", samples=batch * steps) == pytest.approx(
        3.0 * batch * steps * 162.0 / 1000.0, rel=1e-12
    )
    assert trace.transfer_seconds(update_bytes, update_bytes) == pytest.approx(
        2 * update_kbit / 5648.1, rel=1e-12
    )
    assert trace.latency_s == 0.0


def test_an_edited_trace_exports_its_new_speed(tmp_path: Path) -> None:
    import dataclasses

    (trace,) = import_fedscale(dump(tmp_path / "cap", {1: CAPACITY[1]}))
    faster = dataclasses.replace(trace, block_latency_s={"*": 0.3})
    assert fedscale_capacity(faster)["computation"] == pytest.approx(100.0)


def test_availability_follows_fedscale_and_its_modulo_pairing(tmp_path: Path) -> None:
    traces = import_fedscale(dump(tmp_path / "cap", CAPACITY), dump(tmp_path / "behave", BEHAVE))
    keys = list(BEHAVE)
    for trace, client in zip(traces, CAPACITY, strict=True):
        entry = BEHAVE[keys[client % len(keys)]]
        assert trace.period_s == entry["finish_time"]
        for t in [0.5, 99.0, 100.0, 150.0, 200.0, 201.0, 650.0, 999.0, 1100.0, 1650.0, 2950.0]:
            assert trace.is_available(t) == fedscale_is_active(entry, t), (client, t)


def test_without_behaviour_devices_are_always_on(tmp_path: Path) -> None:
    (trace, *_) = import_fedscale(dump(tmp_path / "cap", CAPACITY))
    assert trace.is_available(1e9) and trace.availability == ()


def test_hostile_pickle_is_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.mkdir, (str(marker),))

    path = dump(tmp_path / "evil", {1: {"computation": Payload(), "communication": 1.0}})
    with pytest.raises(ConfigError, match=r"refused to load .*mkdir"):
        import_fedscale(path)
    assert not marker.exists()


def test_classes_are_refused_even_harmless_ones(tmp_path: Path) -> None:
    from collections import OrderedDict

    with pytest.raises(ConfigError, match=r"refused to load collections\.OrderedDict"):
        load_plain_pickle(dump(tmp_path / "od", OrderedDict(a=1)))


@pytest.mark.parametrize(
    ("capacity", "message"),
    [
        ([1, 2], "expected a non-empty dict"),
        ({1: {"computation": 5.0}}, "client 1: 'communication' must be a positive number"),
        ({1: {"computation": -1.0, "communication": 3.0}}, "'computation' must be a positive number"),
    ],
)
def test_malformed_capacity(tmp_path: Path, capacity: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        import_fedscale(dump(tmp_path / "cap", capacity))


def test_malformed_behaviour(tmp_path: Path) -> None:
    cap = dump(tmp_path / "cap", {0: CAPACITY[1]})
    uneven = {0: {"active": [1, 5], "inactive": [2], "finish_time": 10}}
    with pytest.raises(ConfigError, match="equally long"):
        import_fedscale(cap, dump(tmp_path / "b1", uneven))
    never = {0: {"active": [20], "inactive": [30], "finish_time": 10}}
    with pytest.raises(ConfigError, match="never online"):
        import_fedscale(cap, dump(tmp_path / "b2", never))
    with pytest.raises(ConfigError, match="not an integer"):
        import_fedscale(dump(tmp_path / "cap2", {"x": CAPACITY[1]}), dump(tmp_path / "b3", BEHAVE))
    (tmp_path / "junk").write_bytes(b"not a pickle")
    with pytest.raises(ConfigError, match="not a plain-data FedScale pickle"):
        import_fedscale(tmp_path / "junk")


def test_cli_writes_a_trace_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fleet.csv"
    code = traces_import_main(
        [
            "--capacity",
            str(dump(tmp_path / "cap", CAPACITY)),
            "--behave",
            str(dump(tmp_path / "b", BEHAVE)),
            "--out",
            str(out),
            "--memory-budget",
            "123456789",
        ]
    )
    assert code == 0 and "imported 4 FedScale devices" in capsys.readouterr().out
    traces = load_traces(out)
    assert [t.memory_budget_bytes for t in traces] == [123456789] * 4
    assert export_fedscale_capacity(traces) == CAPACITY
