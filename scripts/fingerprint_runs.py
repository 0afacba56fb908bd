"""Fingerprint the six digits runs: a SHA-256 of each run's final weights and of its exported ONNX models.

A refactor that claims "bit-identical weights and exports" (issue 17) is checked by running this script on the
source tree before and after it and comparing the two JSON outputs. The runs go through the command line as
users type it (`nestling simulate`, then `nestling export`), each in its own process.

Any source tree can be fingerprinted with the one virtual environment, e.g. an older commit checked out by
`git worktree add /work/fp-old COMMIT`:

    OMP_NUM_THREADS=1 .venv/bin/python scripts/fingerprint_runs.py --tree /work/fp-old --out old.json
    OMP_NUM_THREADS=1 .venv/bin/python scripts/fingerprint_runs.py --out new.json
    .venv/bin/python scripts/fingerprint_runs.py --compare old.json new.json

The venv's editable install maps `nestling.server` & co. to /work/main's folders through setuptools' import
hook, which would quietly mix two trees (PYTHONPATH alone only moves `nestling` itself). So each child process
removes that hook and maps the packages to `--tree` as that tree's own pyproject.toml lays them out, and after
the command checks that every `nestling` module it imported came from `--tree`.

Weights are compared as tensors, not files (checkpoint formats change between commits): the strategy's state
in the newest `checkpoints/round-*/global.safetensors`, key by key in sorted order, hashing name, dtype, shape
and raw bytes. Each ONNX model is hashed as a file and, separately, by its initializers (name, type, dims,
raw bytes), so a change in node naming alone can be told from a change in the exported numbers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# The six submodel methods of docs/benchmarks.md's "The six submodel methods on digits", shortened to a few
# rounds of one local epoch so the six take a few minutes; one in-process worker and no grouped training, so
# nothing depends on timing (batching "auto" picks by measured speed).
METHODS = ("fedavg", "heterofl", "fjord", "nefl-wd", "depthfl", "scalefl")
COMMON = (
    "--model", "resnet20", "--dataset", "digits", "--clients", "20", "--fraction", "0.5",
    "--local-epochs", "1", "--seed", "0", "--workers", "1", "--backend", "inprocess",
    "--batching", "off", "--quiet",
)  # fmt: skip
# Each run exports its smallest submodel (level 1) and its largest with every exit as an output.
EXPORTS = ("smallest", "largest_all_exits")
# Calibration data (digits, the runs' own) is needed by methods with static BN (HeteroFL).
EXPORT_COMMON = (
    "--calib-samples", "256", "--eval-samples", "200", "--no-benchmark", "--no-simplify", "--threads", "1",
)  # fmt: skip

# Runs `nestling.cli.main(argv)` from the tree given as argv[1], never from the venv's editable install.
BOOTSTRAP = r"""
import importlib.abc, importlib.util, sys
from pathlib import Path
try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

tree = Path(sys.argv[1]).resolve()
argv = sys.argv[2:]
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
sys.path_hooks[:] = [h for h in sys.path_hooks if "__editable__" not in getattr(h, "__module__", "")]
settings = tomllib.loads((tree / "pyproject.toml").read_text()).get("tool", {}).get("setuptools", {})
mapping = {"nestling": "nestling", **settings.get("package-dir", {})}
mapping = {name: (tree / folder).resolve() for name, folder in mapping.items() if name.split(".")[0] == "nestling"}

class TreeFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        folder = mapping.get(fullname)
        if folder is None or not (folder / "__init__.py").is_file():
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)])

sys.meta_path.insert(0, TreeFinder())
from nestling.cli import main
try:
    code = main(argv)
finally:
    strays = sorted(
        f"{name}: {getattr(module, '__file__', None)}" for name, module in list(sys.modules.items())
        if name.split(".")[0] == "nestling" and getattr(module, "__file__", None)
        and not Path(module.__file__).resolve().is_relative_to(tree))
    if strays:
        print("fingerprint: modules imported from outside " + str(tree) + ":\n  " + "\n  ".join(strays),
              file=sys.stderr)
        sys.exit(3)
sys.exit(code)
"""


def tensors_sha256(tensors: dict[str, Any]) -> str:
    """One digest over named tensors in sorted key order: name, dtype, shape and raw bytes of each."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(name.encode() + b"\0" + str(tensor.dtype).encode() + b"\0")
        digest.update(json.dumps(list(tensor.shape)).encode() + b"\0")
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def final_state(run_dir: Path) -> Path:
    """The newest round's strategy state (global.safetensors), whatever the manifest format of the tree."""
    rounds = sorted((run_dir / "checkpoints").glob("round-*/global.safetensors"))
    if not rounds:
        raise SystemExit(f"fingerprint: no checkpoints/round-*/global.safetensors under {run_dir}")
    return rounds[-1]


def onnx_fingerprint(path: Path) -> dict[str, str]:
    """The ONNX file's SHA-256 and a SHA-256 of its initializers alone (name, type, dims, raw bytes)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    digest = hashlib.sha256()
    for init in sorted(model.graph.initializer, key=lambda item: item.name):
        array = numpy_helper.to_array(init)
        digest.update(f"{init.name}\0{init.data_type}\0{list(init.dims)}\0".encode())
        digest.update(array.tobytes())
    return {
        "file_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "initializers_sha256": digest.hexdigest(),
    }


def _nestling(python: str, tree: Path, argv: list[str], log: Path) -> str:
    env = {key: value for key, value in os.environ.items() if key not in ("NESTLING_PLUGINS", "PYTHONPATH")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONHASHSEED"] = "0"
    done = subprocess.run(
        [python, "-c", BOOTSTRAP, str(tree), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=log.parent,
        env=env,
        check=False,
    )
    with log.open("a") as sink:
        sink.write("$ nestling " + " ".join(argv) + "\n" + done.stdout)
    if done.returncode != 0:
        tail = "\n".join(done.stdout.splitlines()[-25:])
        raise SystemExit(f"fingerprint: `nestling {' '.join(argv)}` failed ({done.returncode}):\n{tail}")
    return done.stdout


def tree_commit(tree: Path) -> str | None:
    """The tree's git commit (with '+dirty' when it has uncommitted changes), or None outside git."""
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return None
    dirty = subprocess.run(
        ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    )
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def fingerprint(
    tree: Path,
    methods: list[str],
    rounds: int,
    work: Path,
    python: str,
    export: bool,
    common: tuple[str, ...] = COMMON,
    export_common: tuple[str, ...] = EXPORT_COMMON,
) -> dict[str, Any]:
    """Run each method through `nestling simulate` (and `nestling export`) from `tree`; hash the results."""
    from safetensors.torch import load_file

    runs: dict[str, Any] = {}
    for method in methods:
        run_dir = work / method
        run_dir.mkdir(parents=True)
        log = run_dir / "commands.log"
        argv = [
            "simulate",
            "--method",
            method,
            "--rounds",
            str(rounds),
            *common,
            "--out",
            str(run_dir / "run"),
        ]
        started = time.perf_counter()
        _nestling(python, tree, argv, log)
        state_path = final_state(run_dir / "run")
        state = load_file(str(state_path))
        record: dict[str, Any] = {
            "simulate": "nestling " + " ".join(argv[:-2]),
            "checkpoint": state_path.parent.name,
            "tensors": len(state),
            "state_sha256": tensors_sha256(state),
        }
        if export:
            record["onnx"] = {}
            listing = _nestling(python, tree, ["export", "--checkpoint", str(run_dir / "run"), "--list"], log)
            levels = sum(1 for line in listing.splitlines() if line.count("\t") >= 2)
            if levels == 0:
                raise SystemExit(f"fingerprint: `nestling export --list` named no submodel:\n{listing}")
            for name, flags in zip(EXPORTS, (["--level", "1"], ["--level", str(levels), "--all-exits"])):
                bundle = run_dir / f"export-{name}"
                _nestling(
                    python,
                    tree,
                    [
                        "export",
                        "--checkpoint",
                        str(run_dir / "run"),
                        *flags,
                        *export_common,
                        "--out",
                        str(bundle),
                    ],
                    log,
                )
                record["onnx"][name] = onnx_fingerprint(bundle / "model.onnx")
        record["seconds"] = round(time.perf_counter() - started, 1)
        runs[method] = record
        print(f"{method}: state {record['state_sha256'][:16]} ({record['seconds']} s)", file=sys.stderr)
    return {
        "format": "nestling.fingerprint_runs/1",
        "tree": str(tree),
        "commit": tree_commit(tree),
        "rounds": rounds,
        "common": " ".join(common),
        "export_common": " ".join(export_common) if export else None,
        "runs": runs,
    }


def _digests(record: dict[str, Any]) -> dict[str, str]:
    flat = {"state_sha256": record["state_sha256"]}
    for name, hashes in record.get("onnx", {}).items():
        for kind, value in hashes.items():
            flat[f"onnx.{name}.{kind}"] = value
    return flat


def compare(old_path: Path, new_path: Path) -> int:
    """Print each run's digests that differ between two outputs; exit code 1 when any does."""
    old, new = json.loads(old_path.read_text()), json.loads(new_path.read_text())
    settings = ("rounds", "common", "export_common")
    if [old.get(key) for key in settings] != [new.get(key) for key in settings]:
        raise SystemExit("fingerprint: the two outputs ran different settings; compare like with like")
    differ = False
    for method in sorted(set(old["runs"]) | set(new["runs"])):
        if method not in old["runs"] or method not in new["runs"]:
            print(f"{method}: only in {'new' if method in new['runs'] else 'old'}")
            differ = True
            continue
        a, b = _digests(old["runs"][method]), _digests(new["runs"][method])
        changed = [key for key in sorted(set(a) & set(b)) if a[key] != b[key]]
        same = [key for key in sorted(set(a) & set(b)) if a[key] == b[key]]
        differ = differ or bool(changed)
        print(
            f"{method}: {'DIFFERENT ' + ', '.join(changed) if changed else 'identical'} ({len(same)} equal)"
        )
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    """Command line of the script (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=REPO, help="source tree to run (default: this repo)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated (default: the six)")
    parser.add_argument("--rounds", type=int, default=3, help="communication rounds per run (default 3)")
    parser.add_argument("--no-export", action="store_true", help="hash the weights only")
    parser.add_argument(
        "--limit-train", type=int, help="train on a stratified subset (faster, e.g. to bisect on a busy host)"
    )
    parser.add_argument("--limit-test", type=int, help="evaluate on a stratified subset")
    parser.add_argument(
        "--model", default="resnet20", help="model family member instead of resnet20 (e.g. tinycnn, vit)"
    )
    parser.add_argument("--dataset", default="digits", help="dataset instead of digits (e.g. cifar10)")
    parser.add_argument("--data-root", type=Path, help="folder holding file-backed datasets (cifar10)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="passed on to every `nestling simulate` (repeatable)",
    )
    parser.add_argument("--work", type=Path, help="folder for the runs (default: a temporary one, removed)")
    parser.add_argument("--python", default=sys.executable, help="interpreter of the venv to use")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"), help="diff two outputs")
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    tree = args.tree.resolve()
    if not (tree / "nestling" / "cli.py").is_file():
        raise SystemExit(f"fingerprint: {tree} has no nestling/cli.py; pass a Nestling source tree as --tree")
    methods = [m for m in args.methods.split(",") if m]
    with tempfile.TemporaryDirectory(prefix="fingerprint-") as scratch:
        work = args.work.resolve() if args.work else Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        swaps = {"resnet20": args.model, "digits": args.dataset}
        common = tuple(swaps.get(value, value) for value in COMMON)
        export_common = EXPORT_COMMON
        if args.data_root is not None:  # export calibrates on the run's dataset too
            common += ("--data-root", str(args.data_root.resolve()))
            export_common += ("--data-root", str(args.data_root.resolve()))
        for flag, value in (("--limit-train", args.limit_train), ("--limit-test", args.limit_test)):
            common += (flag, str(value)) if value is not None else ()
        for item in args.set:
            common += ("--set", item)
        result = fingerprint(
            tree, methods, args.rounds, work, args.python, not args.no_export, common, export_common
        )
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
