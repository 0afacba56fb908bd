"""`nestling server --config fleet.toml [--resume]`: the one coordinator, driving a real fleet over MQTT."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nestling.calibration import calibration_subset
from nestling.data import load_dataset
from nestling.errors import NestlingError
from nestling.log_setup import configure_logging
from nestling.numbers import headline, percent
from nestling.run_folder import finished_summary, refuse_existing_run, run_artifacts, start_new_run
from nestling.server.checkpoint import latest_checkpoint
from nestling.server.clock import WallClock
from nestling.server.coordinator import Coordinator, RoundRecord
from nestling.server.deployables import deployable_rows, deployables_table, export_orders, wants_export
from nestling.server.evaluation import Evaluator
from nestling.server.fleet_config import FleetConfig, load_fleet_config
from nestling.server.fleet_plan import write_run_file
from nestling.server.mqtt_transport import MqttTransport, TransportSettings, server_client
from nestling.server.plan_summary import print_plan_table
from nestling.server.registry import DeviceRegistry, emulated_class
from nestling.server.run_report import (
    add_method_results,
    plot_accuracy,
    read_metrics,
    summarise,
    write_summary,
)
from nestling.server.run_setup import round_policy, strategy_for_run
from nestling.server.strategies.base import Strategy
from nestling.wire.topics import FleetTopics

log = logging.getLogger("nestling.fleet")


def transport_settings(cfg: FleetConfig) -> TransportSettings:
    fleet = cfg.fleet
    return TransportSettings(
        chunk_size=fleet.chunk_kb * 1024,
        max_message_bytes=fleet.max_message_mb * 1024 * 1024,
        stall_s=fleet.stall_s,
        round_min_devices=fleet.round_min_devices,
        device_wait_s=fleet.registration_timeout_s,
    )


def make_strategy(
    cfg: FleetConfig, num_classes: int, input_shape: tuple[int, int, int], dataset: str
) -> Strategy:
    """The fleet's strategy, built exactly as `nestling simulate` builds a simulated fleet's (one per board slot)."""
    return strategy_for_run(
        cfg.run,
        num_classes=num_classes,
        input_shape=input_shape,
        num_clients=cfg.fleet.devices,
        dataset=dataset,
    )


def round_line(record: RoundRecord, total: int) -> str:
    """One line per round for the operator: results, rejections, dropouts, time and accuracy per submodel."""
    notes = [f"{record.accepted}/{record.selected} results"]
    if not record.aggregated:
        notes.append("below quorum: model unchanged")
    rejected = sum(v for k, v in record.counters.items() if k.startswith("rejected_"))
    for count, what in ((rejected, "rejected"), (record.counters.get("dropouts", 0), "dropped")):
        if count:
            notes.append(f"{count} {what}")
    if record.replans:  # a board's speed drifted (or it ran out of memory): it trains another submodel now
        moved = ", ".join(f"{r['device']} ({r['reason']})" for r in record.replans)
        notes.append(f"re-planned {moved}")
    accuracies = " ".join(f"{s['name']} {percent(s['accuracy'])}" for s in record.submodels)
    return f"round {record.round + 1}/{total}: {', '.join(notes)}, {record.wall_seconds:.1f}s  {accuracies}"


def finish_exports(
    cfg: FleetConfig, strategy: Strategy, transport: MqttTransport, registry: DeviceRegistry, last_round: int
) -> list[dict[str, Any]] | None:
    """After the last round: send export orders ([export] on_finish), wait for the boards' reports, and
    return summary.json's "deployables" (None when exports are off)."""
    policy = cfg.export
    if policy.on_finish == "off":
        asked = sorted(d for d, r in registry.records.items() if wants_export(r.info.profile))
        if asked:
            print(
                f"{', '.join(asked)} asked for their final model, but fleet.toml's [export] on_finish is off",
                flush=True,
            )
        return None
    orders = export_orders(strategy, registry.available(), last_round, policy.on_finish)
    if orders:
        print(
            f"sending the final model to {len(orders)} boards to export; waiting up to {policy.timeout_s:.0f}s",
            flush=True,
        )
        transport.send_exports(orders)
        transport.wait_exports(policy.timeout_s)
    return deployable_rows(registry.records, transport.exports)


def run_fleet(
    cfg: FleetConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    on_round: Callable[[RoundRecord], None] | None = None,
) -> dict[str, Any]:
    """Wait for the fleet, run (or resume) every round, write metrics.jsonl, checkpoints and summary.json.
    The run folder is touched only once the broker answered: a failed start leaves it exactly as it was; a
    folder holding a run is refused unless `resume` or `overwrite`; a finished run resumed changes nothing."""
    started = time.perf_counter()
    torch.set_num_threads(1)
    run = cfg.run.run
    out_dir = cfg.out_dir
    if resume and not run_artifacts(out_dir):  # a service's first start runs with --resume too
        print(f"no run in {out_dir} yet: starting one", flush=True)
        resume = False
    if resume:
        finished = finished_summary(out_dir, run.rounds)
        if finished is not None:
            print(f"{out_dir} has finished its {run.rounds} rounds: nothing to resume, nothing changed")
            return finished
    else:
        refuse_existing_run(out_dir, overwrite=overwrite)
    opts = {} if cfg.run.data.limit_test is None else {"limit_test": cfg.run.data.limit_test}
    bundle = load_dataset(cfg.run.data.dataset, cfg.run.data.root, seed=run.seed, **opts)
    strategy = make_strategy(cfg, bundle.num_classes, bundle.input_shape, bundle.name)
    # A resumed fleet keeps its boards' indices; a new one starts from none (registry.json is written once
    # the run has started).
    registry = DeviceRegistry(
        out_dir / "registry.json" if resume else None,
        heartbeat_timeout_s=cfg.fleet.heartbeat_timeout_s,
        enrolment=cfg.enrolment,
    )
    topics = FleetTopics(cfg.broker.fleet)
    clock = WallClock()
    transport = MqttTransport(
        server_client(cfg.broker, topics), topics, registry, clock, transport_settings(cfg)
    )
    # Boards measure this run's full model at its batch size (edge/self_profile.py) before they count as ready.
    transport.plan = {"spec": strategy.full_spec.to_dict(), "batch": strategy.batch_size}
    evaluator = Evaluator(
        bundle.test.x,
        bundle.test.y,
        batch_size=run.eval_batch,
        device=run.device,
        calibration=calibration_subset(bundle.train.x, run.calibration_samples, run.seed),
    )
    policy = round_policy(cfg.run)

    def report(record: RoundRecord) -> None:
        print(round_line(record, run.rounds), flush=True)
        if on_round is not None:
            on_round(record)

    coordinator = Coordinator(strategy, transport, clock, evaluator, policy, out_dir, report)
    transport.connect(
        *cfg.broker.host_port
    )  # an unreachable broker ends the start here, the folder untouched
    if resume and latest_checkpoint(out_dir / "checkpoints", warn=False) is not None:
        print(f"resuming after round {coordinator.resume()} of {run.rounds}", flush=True)
    else:
        if resume:
            print("no complete checkpoint yet: starting from round 1", flush=True)
        start_new_run(out_dir, overwrite=overwrite or resume)
        registry.path = out_dir / "registry.json"
    write_run_file(out_dir, strategy)  # `nestling plan --fleet` re-creates the strategy from it
    try:
        transport.publish_status("waiting", coordinator.start_round)
        print(
            f"server for fleet {topics.fleet} on {cfg.broker.url}: waiting for {cfg.min_devices} devices",
            flush=True,
        )
        if cfg.enrolment.open:  # also in the log: an open door must never go unnoticed
            log.warning("%s", cfg.enrolment.describe())
        else:
            print(cfg.enrolment.describe(), flush=True)
        ready = transport.wait_for_devices(cfg.min_devices, cfg.fleet.registration_timeout_s)
        if not ready:
            raise NestlingError(f"no device registered within {cfg.fleet.registration_timeout_s:.0f}s")
        print(f"{len(ready)} devices registered: {', '.join(d.device_id for d in ready)}", flush=True)
        emulated = {d.device_id: emulated_class(d.profile) for d in ready if emulated_class(d.profile)}
        if (
            emulated
        ):  # `nestling agent --emulate`: wall-clock rounds are the emulated boards', not this host's
            print(
                f"{len(emulated)} of them emulate slower boards: "
                f"{', '.join(f'{d} as {c}' for d, c in emulated.items())}",
                flush=True,
            )
        coordinator.run()
        transport.publish_status("done", run.rounds - 1)
        try:
            deployables = finish_exports(cfg, strategy, transport, registry, run.rounds - 1)
        except Exception:  # the run's results are in: a bug in the export step must not lose its summary
            log.exception("end-of-run export failed")
            print(
                "end-of-run export failed (see the log); the run summary is written without deployables",
                flush=True,
            )
            deployables = None
    finally:
        transport.close()
    summary = summarise(read_metrics(out_dir), cfg.to_dict(), time.perf_counter() - started)
    summary["transport"] = dict(sorted(transport.counters.items()))
    summary["quarantined"] = coordinator.quarantine_log  # devices a divergence guard rollback put aside
    add_method_results(summary, strategy, transport.devices(), coordinator.last_eval, run.rounds - 1, out_dir)
    summary["trained_by"] = {spec: sorted(devices) for spec, devices in transport.trained_by.items()}
    if registry.emulated():
        summary["emulated"] = registry.emulated()
    if deployables is not None:
        summary["deployables"] = deployables
        print(deployables_table(deployables), flush=True)
    write_summary(out_dir, summary)
    plot_accuracy(out_dir, f"{cfg.run.method.name} · {cfg.run.model.arch} · fleet {topics.fleet}")
    return summary


def _install_service(config: Path, out: Path, user: str | None) -> int:
    """Write the server's systemd unit, refusing a config that would fail at boot."""
    from nestling.server.service import UNIT_NAME, write_unit

    try:
        load_fleet_config(config)
    except NestlingError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    path = write_unit(config, out, user=user)
    print(f"wrote {path}\nenable it: sudo systemctl daemon-reload && sudo systemctl enable --now {UNIT_NAME}")
    return 0


def server_main(argv: list[str]) -> int:
    """`nestling server --config fleet.toml [--resume]` | `nestling server install-service --config fleet.toml`."""
    parser = argparse.ArgumentParser(
        prog="nestling server", description="Coordinate a fleet of agents over MQTT."
    )
    parser.add_argument("action", nargs="?", choices=("run", "install-service"), default="run")
    parser.add_argument("--config", type=Path, required=True, help="fleet.toml (see examples/fleet.toml)")
    parser.add_argument("--resume", action="store_true", help="continue after the newest complete checkpoint")
    parser.add_argument(
        "--open-enrolment",
        action="store_true",
        help="admit any device id the broker lets in (up to [fleet] devices) instead of fleet.toml's [enrolment]",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run already in the config's out_dir (without it, a folder holding a run is refused)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("/etc/systemd/system"),
        help="install-service: where to write nestling-server.service (default /etc/systemd/system)",
    )
    parser.add_argument(
        "--user", default=None, help="install-service: account the server runs as (default: you)"
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="how much the server logs besides its round lines (default WARNING)",
    )
    args = parser.parse_args(argv)
    configure_logging(
        args.log_level, "%(asctime)s %(name)s %(levelname)s %(message)s", force=True
    )  # the top-level CLI configured WARNING already
    if args.action == "install-service":
        return _install_service(args.config, args.out, args.user)
    try:
        if args.resume and args.overwrite:
            raise NestlingError("--resume continues the run in out_dir and --overwrite replaces it: give one")
        summary = run_fleet(
            load_fleet_config(args.config, open_enrolment=args.open_enrolment),
            resume=args.resume,
            overwrite=args.overwrite,
        )
    except NestlingError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print_plan_table(summary)
    print(
        f"done: {summary['rounds']} rounds, {headline(summary)}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(server_main(sys.argv[1:]))
