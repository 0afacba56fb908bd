"""`nestling plan --fleet RUN_DIR`: what the server would assign next to the boards registered in a fleet run.

The run's strategy is re-created from its newest checkpoint (context, state, and the closed loop's speed factors
and last choices) or, before the first checkpoint, from the run.json the server writes at start; the boards come
from registry.json (index, samples, hand-set budget, pinned tier, the validated profile each reported). The plan
is the strategy's own `assign` + `plan_report`, so it is exactly the sizing the server runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nestling.errors import NestlingError
from nestling.profiler.board_profile import ProfileError, parse_board_profile
from nestling.profiler.estimator import estimate
from nestling.server.checkpoint import latest_checkpoint, load_checkpoint
from nestling.server.registry import JOURNAL_SUFFIX, read_registry
from nestling.server.strategies import StrategyContext, create_strategy
from nestling.server.strategies.base import DeviceInfo, Strategy
from nestling.spec import SubmodelSpec
from nestling.strict_json import strict_dumps

RUN_FILE = "run.json"
RUN_SCHEMA = "nestling.run/1"
PLAN_SCHEMA = "nestling.fleet_plan/1"


def write_run_file(out_dir: Path, strategy: Strategy) -> Path:
    """What a fleet run plans with, written when it starts (a run without checkpoints can still be planned)."""
    path = out_dir / RUN_FILE
    record = {"schema": RUN_SCHEMA, "method": strategy.name, "context": strategy.ctx.to_record()}
    path.write_text(strict_dumps(record, indent=1, sort_keys=True))
    return path


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise NestlingError(f"cannot read {path}: {exc}") from None


def load_run_strategy(
    run_dir: Path, *, deadline_s: float | None = None, train_share: float | None = None
) -> tuple[Strategy, int, str]:
    """(strategy as the server holds it now, the next round, where it came from). `deadline_s` and
    `train_share` replace the run's (what would the boards get with another deadline?)."""
    if not run_dir.is_dir():
        raise NestlingError(f"--fleet {run_dir}: no such run folder")
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    tensors: dict[str, Any] | None = None
    if checkpoint is not None:
        tensors, manifest = load_checkpoint(checkpoint)
        method, context, next_round = manifest["method"], manifest["context"], int(manifest["round"]) + 1
        source = f"checkpoint {checkpoint.name}"
    elif (run_dir / RUN_FILE).is_file():
        manifest = _read_json(run_dir / RUN_FILE)
        if not isinstance(manifest, dict) or manifest.get("schema") != RUN_SCHEMA:
            raise NestlingError(f"{run_dir / RUN_FILE} is not a {RUN_SCHEMA} record")
        method, context, next_round, source = manifest["method"], manifest["context"], 0, RUN_FILE
    else:
        raise NestlingError(
            f"--fleet {run_dir}: neither checkpoints/ nor {RUN_FILE} (is it a fleet run's out_dir?)"
        )
    ctx = StrategyContext.from_record(context)
    if deadline_s is not None:
        if deadline_s <= 0:
            raise NestlingError(f"--deadline must be > 0, got {deadline_s}")
        ctx.deadline_s = deadline_s
    if train_share is not None:
        if not 0 < train_share <= 1:
            raise NestlingError(f"--train-share must be in (0, 1], got {train_share}")
        ctx.train_share = train_share
    strategy = create_strategy(method, ctx)
    if tensors is not None:
        strategy.load_state(tensors, manifest.get("strategy", {}))
        strategy.load_planning_state(manifest.get("planning") or {})
    return strategy, next_round, source


def registered_devices(run_dir: Path) -> list[DeviceInfo]:
    """The boards in the run's registry.json as the strategies see them (profiles validated again)."""
    path = run_dir / "registry.json"
    if not path.is_file() and not path.with_name(path.name + JOURNAL_SUFFIX).is_file():
        raise NestlingError(f"--fleet {run_dir}: no registry.json (no board has registered yet)")
    try:
        devices = read_registry(path)[1]
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise NestlingError(f"cannot read {path}: {exc}") from None
    out = []
    for device_id, entry in sorted(devices.items()):
        try:
            board = (
                None if entry.get("board_profile") is None else parse_board_profile(entry["board_profile"])
            )
            tier = entry.get("tier")
            labels = entry.get("labels")
            out.append(
                DeviceInfo(
                    device_id,
                    int(entry["index"]),
                    int(entry["num_samples"]),
                    profile={},
                    memory_budget_bytes=entry.get("memory_budget_bytes"),
                    labels=None if labels is None else tuple(int(x) for x in labels),
                    board=board,
                    tier=None if tier is None else int(tier),
                )
            )
        except (ProfileError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise NestlingError(f"{path}: device {device_id!r}: {exc}") from None
    if not out:
        raise NestlingError(f"{path}: no registered boards")
    return out


def fleet_plan(strategy: Strategy, devices: list[DeviceInfo], round_index: int) -> list[dict[str, Any]]:
    """One row per board: the submodel the strategy assigns it in `round_index`, why, its estimated memory,
    predicted training time against the time allowed, and whether that is a re-plan."""
    names = {target.spec.id: target.name for target in strategy.eval_targets()}
    tasks = strategy.assign(round_index, devices)
    plans, replans = strategy.plan_report(round_index, devices, tasks)
    moved = {r["device"]: r["from"] for r in replans}
    rows = []
    for device in devices:
        task = tasks[device.device_id]
        plan = plans.get(device.device_id, {})
        if plan:
            reason = plan["reason"]
        elif device.memory_budget_bytes is not None:
            reason = "hand-set budget"
        elif device.tier is not None:
            reason = "pinned"
        else:
            reason = "no profile"  # sized as the method sizes unprofiled boards (by index, by tier, or not)
        rows.append(
            {
                "device": device.device_id,
                "index": device.index,
                "spec": task.spec_id,
                "submodel": names.get(task.spec_id, task.spec_id[:8]),
                "reason": reason,
                "memory_bytes": estimate(
                    SubmodelSpec.from_dict(task.spec), strategy.batch_size
                ).training_bytes,
                "budget_bytes": strategy.memory_budget_of(device),
                "predicted_s": plan.get("predicted_s"),
                "time_budget_s": strategy.time_budget_s,
                "speed": plan.get("speed"),
                "source": plan.get("source"),
                "replan_from": moved.get(device.device_id),
            }
        )
    return rows


def fleet_plan_json(
    run_dir: Path, strategy: Strategy, round_index: int, source: str, rows: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "schema": PLAN_SCHEMA,
        "run": str(run_dir),
        "from": source,
        "method": strategy.name,
        "model": strategy.ctx.arch,
        "batch": strategy.batch_size,
        "round": round_index,
        "deadline_s": strategy.ctx.deadline_s,
        "train_share": strategy.ctx.train_share,
        "time_budget_s": strategy.time_budget_s,
        "devices": rows,
    }


__all__ = [
    "PLAN_SCHEMA",
    "RUN_FILE",
    "fleet_plan",
    "fleet_plan_json",
    "load_run_strategy",
    "registered_devices",
    "write_run_file",
]
