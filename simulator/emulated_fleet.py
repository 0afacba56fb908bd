"""A replayed fleet of emulated catalogue boards on the virtual clock: the closed loop without processes.

Each device trains and transfers exactly as `nestling agent --emulate CLASS` pads itself (edge/emulation.py:
training FLOPs at the class's sustained speed, times any injected slowdown; links of its class), and reports
the class's profile (edge/self_profile.emulated_profile), so the coordinator plans, predicts and corrects on
the same figures a loopback fleet of emulating agents gives it — on one core, in virtual time.
"""

from __future__ import annotations

from dataclasses import replace

from nestling.edge.emulation import EmulatedDevice, EmulationTarget
from nestling.edge.self_profile import ProfileInputs, emulated_profile
from nestling.messages import Task
from nestling.profiler.board_profile import BoardProfile, ProfileError
from nestling.profiler.speed import MacCounter, payload_bytes, task_training_flops
from nestling.profiler.traces import DeviceTrace
from nestling.server.strategies.base import DeviceInfo
from nestling.simulator.durations import Arrival, TaskCost
from nestling.spec import SubmodelSpec


class EmulatedBoards:
    """Always-online devices, each one an emulated board (its EmulationTarget, slowdowns included)."""

    def __init__(
        self,
        boards: dict[str, EmulationTarget],
        num_samples: dict[str, int],
        input_shape: tuple[int, int, int],
    ) -> None:
        self.boards = boards
        self.num_samples = num_samples
        self.macs = MacCounter(input_shape)

    def online(self, device: DeviceInfo, t: float) -> DeviceInfo | None:
        return device

    def next_online(self, device: DeviceInfo, t: float) -> float:
        return t

    def cost(self, task: Task) -> TaskCost:
        """The phases an emulating agent pads this task to."""
        target = self.boards[task.device_id]
        board = EmulatedDevice(target.figures)
        flops = task_training_flops(task, self.num_samples[task.device_id], self.macs)
        nbytes = payload_bytes(task.weights)
        return TaskCost(
            down_s=board.transfer_seconds(nbytes, "down"),
            compute_s=board.compute_seconds(flops) * target.slowdown_at(task.round),
            up_s=board.transfer_seconds(nbytes, "up"),
        )

    def arrival(self, task: Task, t: float) -> Arrival:
        cost = self.cost(task)
        return Arrival(cost.total_s, cost=cost)


def profiled(
    devices: list[DeviceInfo], boards: dict[str, EmulationTarget], full_spec: SubmodelSpec, batch: int
) -> list[DeviceInfo]:
    """The devices as the server registers them when each board sent its emulated class's profile."""
    out = []
    for device in devices:
        target = boards[device.device_id]
        inputs = ProfileInputs(full_spec.to_dict(), batch, "cpu", 0.0, target.name)
        out.append(replace(device, board=emulated_profile(inputs, target)))
    return out


def trace_profile(trace: DeviceTrace, full_spec: SubmodelSpec, batch: int) -> BoardProfile | None:
    """What `nestling agent --emulate-trace` sends for this trace device: its figures as a board profile (the
    speed the replay times it at), so a replayed device is planned as the fleet server plans that agent. None
    when the trace has no speed for the model (the device is then sized by memory alone, as before)."""
    inputs = ProfileInputs(full_spec.to_dict(), batch, "cpu", 0.0, trace.device_class)
    try:
        return emulated_profile(inputs, EmulationTarget.of_trace(trace))
    except ProfileError:
        return None
