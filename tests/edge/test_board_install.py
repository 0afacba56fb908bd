"""A board install (`bash scripts/setup.sh --board`: pyproject's base dependencies, no [workstation] extra) runs
the agent: every path `nestling agent` takes — its modules, its data, a training task, its self-profile's
pieces, its own ONNX export and `nestling infer` — imports nothing the board did not install.

The child process blocks the workstation-only packages with a meta-path finder, so a stray import fails
here as it would on a Raspberry Pi, whatever this workstation has installed. It blocks as well what setup.sh
--board leaves out of the board's venv (the `tests` packages of sympy, numpy and networkx) and records every
file opened or program started under what it removes (onnx's backend test data, torch's protoc), so nothing
the agent runs can need them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

from nestling.cli import WORKSTATION_MODULES

REPO = Path(__file__).resolve().parents[2]

BLOCKER = """
import importlib.abc, sys
BLOCKED = {blocked!r}
# What setup.sh --board removes from the board's venv: test packages, test data, torch's protobuf compiler.
PRUNED_TESTS = ("sympy", "numpy", "networkx")
PRUNED_FILES = ("/onnx/backend/test/data", "/torch/bin/protoc")
PRUNED_TOUCHED = []
def pruned_module(name):
    parts = name.split(".")
    return parts[0] in PRUNED_TESTS and "tests" in parts
def record_pruned_files(event, args):
    if event in ("open", "subprocess.Popen", "os.exec", "os.posix_spawn") and args:
        path = str(args[0])
        if any(part in path for part in PRUNED_FILES):
            PRUNED_TOUCHED.append(path)
sys.addaudithook(record_pruned_files)
class BoardInstall(importlib.abc.MetaPathFinder):
    # Every finder, except that a blocked package is absent: import fails, find_spec answers None.
    def __init__(self, finders):
        self.finders = finders
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED or pruned_module(name):
            return None
        for finder in self.finders:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                return spec
        return None
sys.meta_path[:] = [BoardInstall(list(sys.meta_path))]
"""

AGENT_PATHS = """
import os, pkgutil, importlib, tempfile, contextlib, io
from pathlib import Path
import numpy as np, torch
torch.set_num_threads(1)
import nestling.edge, nestling.edge.procedures
from nestling.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main(["agent", "--help"])
    except SystemExit as exit:
        assert exit.code == 0, exit.code
for package in (nestling.edge, nestling.edge.procedures):
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
from nestling.edge.agent_cli import load_client_data
from nestling.edge.agent_config import DataSection
from nestling.edge.board_export import export_on_board
from nestling.edge.export_settings import ExportSection
from nestling.edge.self_profile import measure_task_s
from nestling.edge.trainer import run_task
from nestling.errors import DependencyError
from nestling.export.infer import BundleRunner
from nestling.messages import Task
from nestling.models import ModelConfig, build
from nestling.profiler.measure import profile_model
from nestling.spec import SubmodelSpec
from nestling.wire.export_messages import ExportOrder

data_section = DataSection(dataset="synthetic", num_clients=4, client_index=1, limit_train=200)
data = load_client_data(data_section)
spec = SubmodelSpec.full(ModelConfig("tinycnn", num_classes=10, in_channels=3, image_size=16))
weights = build(spec).state_dict()
hparams = {"local_steps": 2, "batch_size": 8, "lr": 0.05, "momentum": 0.9, "seed": 0}
result = run_task(Task(1, "fedavg", spec.to_dict(), weights, "sgd", hparams=hparams, task_id="t1"), data)
trained = result.weights
profile_model(spec, 4, "cpu", repeats=1, warmup=0, rss_check=False)
measure_task_s(spec, 4, "cpu", 0.0, repeats=1)
with tempfile.TemporaryDirectory() as tmp:
    order = ExportOrder("b1", 1, "o1", "full", spec.to_dict(), trained, method="fedavg")
    settings = ExportSection(out_dir=str(Path(tmp) / "bundle"), calib_samples=16, eval_samples=20)
    report = export_on_board(order, settings, fleet="lab", device_id="b1", data=data_section)
    assert report.status == "ok", report.error
    x = np.zeros((2, 3, 16, 16), dtype=np.float32)
    assert BundleRunner(Path(report.bundle)).run(x).shape == (2, 10)
try:
    load_client_data(DataSection(dataset="digits"))
    raise AssertionError("digits loaded without scikit-learn")
except DependencyError as exc:
    assert "scikit-learn" in str(exc) and "synthetic" in str(exc), exc
leaked = sorted(name for name in sys.modules if name.split(".")[0] in BLOCKED or pruned_module(name))
assert not leaked, leaked
assert not PRUNED_TOUCHED, PRUNED_TOUCHED
print("board paths ok")
"""


def _run_blocked(body: str, blocked: set[str]) -> subprocess.CompletedProcess[str]:
    code = BLOCKER.format(blocked=sorted(blocked)) + body
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=240,
        cwd="/",
        env=env,
        check=False,
    )


def test_the_board_dependency_set_is_pyprojects_base_and_leaves_the_workstation_out() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = {
        d.split(";")[0].split(">")[0].split("<")[0].split("=")[0].strip() for d in project["dependencies"]
    }
    assert base == {
        "torch",
        "numpy",
        "safetensors",
        "onnx",
        "onnxruntime",
        "psutil",
        "paho-mqtt",
        "msgspec",
        "tomli",
    }
    workstation = {d.split(">")[0] for d in project["optional-dependencies"]["workstation"]}
    assert workstation == {"amqtt", "rich", "matplotlib", "scikit-learn", "cryptography", "Pillow"}
    assert set(WORKSTATION_MODULES.values()) - {"scipy"} == workstation


def test_the_agents_paths_import_only_what_a_board_installs() -> None:
    done = _run_blocked(AGENT_PATHS, set(WORKSTATION_MODULES))
    assert done.returncode == 0 and "board paths ok" in done.stdout, done.stderr[-3000:]


def test_a_workstation_command_on_a_board_says_what_to_install() -> None:
    body = (
        "from nestling.cli import main\n"
        "assert main(['simulate', '--rounds', '1']) == 2\n"
        "assert main(['demo']) == 2\n"
    )
    done = _run_blocked(body, set(WORKSTATION_MODULES))
    assert done.returncode == 0, done.stderr[-3000:]
    errors = done.stderr.strip().splitlines()
    assert len(errors) == 2 and all("pip install 'nestling[workstation]'" in line for line in errors), errors
    assert all("needs rich" in line for line in errors)


def test_the_guard_catches_what_setup_leaves_out_of_a_board() -> None:
    """The blocker and the file record above do catch a pruned test package and a pruned data file."""
    body = (
        "import importlib.util, onnx\n"
        "from pathlib import Path\n"
        "assert importlib.util.find_spec('numpy._core.tests') is None\n"
        "assert importlib.util.find_spec('numpy.testing') is not None\n"
        "data = Path(onnx.__file__).parent / 'backend' / 'test' / 'data' / 'missing.pb'\n"
        "try:\n"
        "    open(data, 'rb')\n"
        "except OSError:\n"
        "    pass\n"
        "print(PRUNED_TOUCHED)\n"
    )
    done = _run_blocked(body, set())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "onnx/backend/test/data/missing.pb" in done.stdout, done.stdout
