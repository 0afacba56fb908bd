"""The `nestling` command: one entry point, subcommands imported lazily (so `infer` never loads torch)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nestling.errors import NestlingError
from nestling.log_setup import configure_logging
from nestling.plugins import load_plugins

# subcommand → (module, function taking argv); modules are imported only when their command runs.
EXTERNAL_COMMANDS: dict[str, tuple[str, str, str]] = {
    "broker": ("nestling.server.broker", "broker_main", "run the embedded MQTT broker"),
    "broker-config": (
        "nestling.server.broker_config",
        "broker_config_main",
        "write mosquitto config, ACLs, passwords, certs",
    ),
    "server": ("nestling.server.fleet", "server_main", "coordinate a fleet over MQTT"),
    "agent": ("nestling.edge.agent_cli", "agent_main", "run the board agent (or: agent install-service)"),
    "profile": (
        "nestling.profiler.cli",
        "profile_main",
        "measure per-block latency and memory on this machine",
    ),
    "plan": (
        "nestling.server.plan_cli",
        "plan_main",
        "turn device budgets into submodels / depth decompositions",
    ),
    "export": (
        "nestling.export.cli",
        "export_main",
        "export a trained submodel as an ONNX / TensorRT bundle",
    ),
    "upgrade-checkpoint": (
        "nestling.server.checkpoint_upgrade",
        "upgrade_main",
        "describe the submodels of checkpoints written by an older Nestling",
    ),
    "reproduce": (
        "nestling.simulator.reproduce_cli",
        "reproduce_main",
        "run a seed paper's comparison over seeds and check its claims",
    ),
    "infer": ("nestling.export.infer", "infer_main", "run an exported bundle with onnxruntime + numpy only"),
    "traces": ("nestling.simulator.traces_cli", "traces_main", "generate or import device traces"),
}

# Modules of the [workstation] extra (pyproject.toml) → their distribution: absent on a board install.
WORKSTATION_MODULES = {
    "amqtt": "amqtt",
    "rich": "rich",
    "matplotlib": "matplotlib",
    "sklearn": "scikit-learn",
    "scipy": "scipy",
    "cryptography": "cryptography",
    "PIL": "Pillow",
}

SIMULATE_FLAGS: list[tuple[str, str, type, str]] = [
    (
        "--method",
        "method.name",
        str,
        "one of the registered methods (listed by --help)",
    ),
    ("--model", "model.arch", str, "tinycnn, resnet20/56/110, preresnet20, resnet18/34, resnet18-cifar, vit"),
    (
        "--dataset",
        "data.dataset",
        str,
        "digits (default, no download), synthetic, fashion-mnist, cifar10, cifar100",
    ),
    ("--data-root", "data.root", str, "folder holding the dataset files"),
    ("--partition", "data.partition", str, "iid, dirichlet, balanced-dirichlet, shards, unbalanced, scalefl"),
    ("--alpha", "data.alpha", float, "Dirichlet concentration"),
    ("--clients", "data.clients", int, "number of clients"),
    ("--limit-train", "data.limit_train", int, "use a stratified subset of the training set"),
    ("--limit-test", "data.limit_test", int, "use a stratified subset of the test set"),
    ("--fraction", "train.fraction", float, "clients per round / clients"),
    ("--rounds", "run.rounds", int, "communication rounds"),
    ("--local-epochs", "train.local_epochs", int, "local epochs per round"),
    ("--local-steps", "train.local_steps", int, "local SGD steps per round (overrides epochs)"),
    ("--batch", "train.batch_size", int, "local batch size"),
    ("--lr", "train.lr", float, "initial learning rate"),
    ("--lr-schedule", "train.schedule", str, "constant, step, cosine, exponential"),
    ("--momentum", "train.momentum", float, "SGD momentum"),
    ("--weight-decay", "train.weight_decay", float, "SGD weight decay"),
    ("--seed", "run.seed", int, "seed of partitions, init, selection and local training"),
    ("--device", "run.device", str, "cpu or cuda[:i]"),
    ("--workers", "run.workers", int, "worker processes (0 = one per core, 1 = in-process)"),
    ("--eval-every", "run.eval_every", int, "evaluate every N rounds (and at the end; 0: only at the end)"),
    ("--budgets", "method.budgets", str, "FeDepth budget scenario: fair, lack or surplus"),
    ("--traces", "run.traces", str, "device trace file (.jsonl/.csv): replay the fleet on a virtual clock"),
    ("--backend", "run.backend", str, "auto, inprocess, pool or ray (pip install nestling[ray])"),
    ("--batching", "run.batching", str, "train same-spec clients together: off, on, auto (only when faster)"),
]


def _parse_value(raw: str) -> Any:
    import json

    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _registered_methods() -> list[str]:
    """Every method a run can name: the strategy registry, including plugins imported before the CLI runs."""
    from nestling.server.strategies import STRATEGIES

    return sorted(STRATEGIES)


def simulate_parser(prog: str = "nestling simulate") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Run a federated simulation in one process.")
    parser.add_argument(
        "--config", type=Path, help="TOML config file ([run] [data] [model] [method] [train])"
    )
    for flag, _, kind, help_text in SIMULATE_FLAGS:
        if flag == "--method":
            help_text = ", ".join(_registered_methods())
        elif flag == "--model":
            from nestling.models.zoo import known_models

            help_text = ", ".join(known_models())
        parser.add_argument(flag, type=kind, help=help_text)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="any other config value, e.g. --set method.flex=1 (repeatable)",
    )
    parser.add_argument(
        "--unset",
        action="append",
        default=[],
        metavar="SECTION.KEY",
        help="drop a key the --config file sets, e.g. --unset method.flex (repeatable)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="run folder to create (config.toml, metrics.jsonl, summary.json, accuracy.png, checkpoints/); "
        "default runs/METHOD-MODEL-DATASET",
    )
    parser.add_argument(
        "--resume", type=Path, metavar="DIR", help="continue the run in DIR from its newest checkpoint"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run already in --out (without it, a folder holding a run is refused)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def simulate_overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for flag, dotted, _, _ in SIMULATE_FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            overrides[dotted] = value
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep or "." not in key:
            raise NestlingError(f"--set expects SECTION.KEY=VALUE, got '{item}'")
        overrides[key] = _parse_value(raw)
    return overrides


def options_left_behind(config_path: Path | None, method: str | None) -> tuple[str, ...]:
    """When --method replaces the file's method, the file's [method] options the new method does not have
    (NeFL's `flex` under `--method heterofl`) belong to the old one: dropped, with a note, not an error."""
    from nestling.config import read_config_file
    from nestling.server.strategies import STRATEGIES

    if config_path is None or method is None or method not in STRATEGIES:
        return ()
    table = read_config_file(config_path).get("method", {})
    if not isinstance(table, dict) or table.get("name", method) == method:
        return ()
    known = STRATEGIES[method].option_defaults
    dropped = [key for key in table if key not in ("name", "options") and key not in known]
    if dropped:
        print(
            f"note: {config_path}'s [method] options {', '.join(dropped)} are {table.get('name')}'s; "
            f"--method {method} runs without them",
            file=sys.stderr,
        )
    return tuple(f"method.{key}" for key in dropped)


def simulate_main(argv: list[str]) -> int:
    from nestling.config import load_config
    from nestling.progress import RoundProgress, print_submodel_table
    from nestling.run_folder import check_resumable, finished_summary, refuse_existing_run
    from nestling.simulator.run import run_simulation

    args = simulate_parser().parse_args(argv)
    if args.resume is not None and (args.out is not None or args.overwrite):
        raise NestlingError("--resume DIR continues the run in DIR: give it without --out or --overwrite")
    config_path = args.config
    if args.resume is not None:
        check_resumable(args.resume)
        if config_path is None and (args.resume / "config.toml").exists():
            config_path = args.resume / "config.toml"
    unset = (*args.unset, *options_left_behind(config_path, args.method))
    cfg = load_config(config_path, simulate_overrides(args), unset)
    out = args.resume or args.out or Path("runs") / f"{cfg.method.name}-{cfg.model.arch}-{cfg.data.dataset}"
    if args.resume is not None:
        finished = finished_summary(out, cfg.run.rounds)
        if finished is not None:
            print(f"{out} has finished its {cfg.run.rounds} rounds: nothing to resume, nothing changed")
            print_submodel_table(finished)
            return 0
    else:
        refuse_existing_run(out, overwrite=args.overwrite)  # before any data is loaded
    with RoundProgress(
        cfg.run.rounds, enabled=not args.quiet, title=f"{cfg.method.name} · {cfg.model.arch}"
    ) as progress:
        summary = run_simulation(
            cfg, out, resume=args.resume is not None, overwrite=args.overwrite, on_round=progress.update
        )
    print_submodel_table(summary)
    report = (summary.get("replay") or {}).get("report")
    if report:
        print(f"replay report: {report} (timeline.jsonl keeps each trace device's id beside its dev-NNNNN)")
    print(f"results in {out}")
    return 0


def demo_main(argv: list[str]) -> int:
    """The main job on the embedded default: embedded broker, a server and four agents of unequal budgets."""
    return _run_external("nestling.server.fleet_demo", "demo_main", argv)


def missing_module(exc: ModuleNotFoundError) -> NestlingError:
    """What to install for a command whose module is absent (a board install has no [workstation] extra)."""
    top = (exc.name or "").split(".")[0]
    if top in WORKSTATION_MODULES:
        return NestlingError(
            f"this command needs {WORKSTATION_MODULES[top]} (module '{exc.name}'), which a board install "
            "leaves out: pip install 'nestling[workstation]' (or bash scripts/setup.sh without --board)"
        )
    return NestlingError(f"this command needs the module '{exc.name}', which is not installed")


def _run_external(module: str, function: str, argv: list[str]) -> int:
    try:
        entry: Callable[[list[str]], int] = getattr(importlib.import_module(module), function)
    except ModuleNotFoundError as exc:
        raise missing_module(exc) from None
    return int(entry(argv) or 0)


def print_usage(commands: dict[str, str]) -> None:
    print("usage: nestling COMMAND [options]   (nestling COMMAND --help: that command's options)\n")
    print("commands:")
    for name, help_text in commands.items():
        print(f"  {name:<18} {help_text}")
    print("\noptions:")
    print(f"  {'-h, --help':<18} this list")
    print(f"  {'-V, --version':<18} the installed Nestling version")


def main(argv: list[str] | None = None) -> int:
    """The console entry point; output cut short by a closed pipe (`nestling -h | head`) ends quietly."""
    try:
        try:
            return dispatch(list(sys.argv[1:] if argv is None else argv))
        finally:
            sys.stdout.flush()  # here, where a closed pipe can still be caught (and after argparse's exit)
    except BrokenPipeError:
        # the reader left: send what is still buffered nowhere, so the interpreter's last flush cannot fail
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def dispatch(argv: list[str]) -> int:
    commands = {
        "simulate": "run a federated simulation in one process",
        "demo": "the embedded-default demo",
        **{name: help_text for name, (_, _, help_text) in EXTERNAL_COMMANDS.items()},
    }
    if not argv or argv[0] in ("-h", "--help"):
        print_usage(commands)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from nestling import __version__

        print(f"nestling {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    configure_logging(logging.WARNING, "%(levelname)s %(name)s: %(message)s")
    try:
        load_plugins()  # $NESTLING_PLUGINS: families, methods, procedures, board classes of the user's own
        if command == "simulate":
            return simulate_main(rest)
        if command == "demo":
            return demo_main(rest)
        if command in EXTERNAL_COMMANDS:
            module, function, _ = EXTERNAL_COMMANDS[command]
            return _run_external(module, function, rest)
        print(f"error: unknown command '{command}' (known: {', '.join(commands)})", file=sys.stderr)
        return 2
    except NestlingError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # `simulate` imports its progress table (rich) itself
        print(f"error: NestlingError: {missing_module(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
