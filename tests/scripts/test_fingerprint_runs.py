"""scripts/fingerprint_runs.py: a run fingerprinted twice hashes the same, and a tree is run from itself only.

The old-versus-new comparison it exists for (issue 17's bit-identical claim) takes most of an hour per tree and
is recorded in docs/benchmarks.md. Here one tiny tinycnn run, twice, checks the weight digest is deterministic
(the exports too, in the slow test), and small fake trees check that the child process imports the given tree,
never the venv's editable install, and refuses to finish when a `nestling` module came from elsewhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "fingerprint_runs.py"
# One round of tinycnn on 200 digits: a few seconds of training, the rest is importing torch.
TINY = ("--rounds", "1", "--model", "tinycnn", "--limit-train", "200", "--limit-test", "100")


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fingerprint_runs", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=900
    )


def _fingerprint_twice(tmp_path: Path, *args: str) -> list[dict[str, object]]:
    outputs = []
    for name in ("first", "second"):
        done = _run(*args, "--out", str(tmp_path / f"{name}.json"), cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "imported from outside" not in done.stderr
        outputs.append(json.loads((tmp_path / f"{name}.json").read_text()))
    return outputs


@pytest.mark.slow  # four `nestling simulate` processes; the comparison logic is tested in-process above
def test_one_run_fingerprinted_twice_hashes_the_same_weights(tmp_path: Path) -> None:
    first, second = _fingerprint_twice(tmp_path, "--methods", "fedavg", "--no-export", *TINY)
    assert first["tree"] == str(REPO) and re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", str(first["commit"]))
    assert first["export_common"] is None and "--model tinycnn" in str(first["common"])
    run, again = first["runs"]["fedavg"], second["runs"]["fedavg"]  # type: ignore[index]
    assert len(run["state_sha256"]) == 64 and run["tensors"] > 0 and "onnx" not in run
    assert (run["state_sha256"], run["tensors"], run["checkpoint"]) == (
        again["state_sha256"],
        again["tensors"],
        again["checkpoint"],
    )
    assert run["checkpoint"] == "round-000000"  # one round: the newest checkpoint is round 0's
    same = _run("--compare", str(tmp_path / "first.json"), str(tmp_path / "second.json"), cwd=tmp_path)
    assert same.returncode == 0 and same.stdout.strip() == "fedavg: identical (1 equal)", same.stdout


@pytest.mark.slow
def test_exports_fingerprinted_twice_hash_the_same(tmp_path: Path) -> None:
    first, second = _fingerprint_twice(tmp_path, "--methods", "heterofl", *TINY)
    run, again = first["runs"]["heterofl"], second["runs"]["heterofl"]  # type: ignore[index]
    assert set(run["onnx"]) == {"smallest", "largest_all_exits"}
    assert run["onnx"] == again["onnx"] and run["state_sha256"] == again["state_sha256"]
    # HeteroFL's smallest and largest widths are different models: the two exports must not hash alike.
    smallest, largest = run["onnx"]["smallest"], run["onnx"]["largest_all_exits"]
    assert smallest["initializers_sha256"] != largest["initializers_sha256"]


def _output(tmp_path: Path, name: str, runs: dict[str, object], rounds: int = 3) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"rounds": rounds, "common": "x", "export_common": "y", "runs": runs}))
    return path


def test_compare_names_the_digest_that_changed_and_exits_1(tmp_path: Path) -> None:
    run = {"state_sha256": "a" * 64, "onnx": {"smallest": {"file_sha256": "b" * 64}}}
    old = _output(tmp_path, "old", {"fedavg": run, "fjord": run})
    changed = {**run, "onnx": {"smallest": {"file_sha256": "c" * 64}}}
    new = _output(tmp_path, "new", {"fedavg": changed, "fjord": run})
    done = _run("--compare", str(old), str(new), cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        "fedavg: DIFFERENT onnx.smallest.file_sha256 (1 equal)",
        "fjord: identical (2 equal)",
    ]
    assert _run("--compare", str(old), str(old), cwd=tmp_path).returncode == 0


def test_compare_reports_a_missing_run_and_refuses_different_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _script()
    run = {"state_sha256": "a" * 64}
    old = _output(tmp_path, "old", {"fedavg": run, "fjord": run})
    assert script.compare(old, _output(tmp_path, "fewer", {"fedavg": run})) == 1
    assert "fjord: only in old" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="different settings"):
        script.compare(old, _output(tmp_path, "other", {"fedavg": run, "fjord": run}, rounds=2))


def test_tensor_digest_covers_names_dtypes_shapes_and_bytes() -> None:
    digest = _script().tensors_sha256
    weights = {"b": torch.arange(6, dtype=torch.float32), "a": torch.ones(2, 3, dtype=torch.bfloat16)}
    reference = digest(weights)
    assert digest(dict(reversed(weights.items()))) == reference
    assert digest({**weights, "b": weights["b"].reshape(2, 3)}) != reference
    assert digest({**weights, "b": weights["b"].double()}) != reference
    assert digest({**weights, "b": weights["b"] + 1e-7}) != reference
    assert digest({"c": weights["b"], "a": weights["a"]}) != reference


def _fake_tree(root: Path, package_dir: str, cli_body: str = "") -> Path:
    """A tree whose `nestling` CLI only reports where `nestling` and `nestling.server` were imported from."""
    (root / "nestling").mkdir(parents=True)
    (root / "srv").mkdir()
    (root / "pyproject.toml").write_text(f"[tool.setuptools]\npackage-dir = {{ {package_dir} }}\n")
    (root / "nestling" / "__init__.py").write_text("")
    (root / "srv" / "__init__.py").write_text("")
    (root / "nestling" / "cli.py").write_text(
        "import nestling, nestling.server\n"
        "def main(argv):\n"
        f"{cli_body}"
        "    print(nestling.__file__, nestling.server.__file__, *argv)\n"
        "    return 0\n"
    )
    return root


def _bootstrap(tree: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _script().BOOTSTRAP, str(tree), *argv],
        cwd=tree.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_child_imports_the_given_tree_as_its_pyproject_maps_it(tmp_path: Path) -> None:
    tree = _fake_tree(tmp_path / "tree", '"nestling" = "nestling", "nestling.server" = "srv"')
    done = _bootstrap(tree, "hello")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        str(tree / "nestling" / "__init__.py"),
        str(tree / "srv" / "__init__.py"),
        "hello",
    ]


def test_a_package_missing_from_the_tree_is_not_taken_from_the_installed_one(tmp_path: Path) -> None:
    tree = _fake_tree(tmp_path / "tree", '"nestling" = "nestling"')  # no nestling.server mapping
    done = _bootstrap(tree)
    assert done.returncode != 0
    assert "No module named 'nestling.server'" in done.stderr


def test_a_nestling_module_loaded_from_elsewhere_fails_the_run(tmp_path: Path) -> None:
    # The command succeeds, but one `nestling` module it used did not come from the tree: exit 3, named.
    (tmp_path / "elsewhere.py").write_text("")
    smuggle = (
        "    import importlib.util, sys\n"
        f"    spec = importlib.util.spec_from_file_location('nestling.stray', {str(tmp_path / 'elsewhere.py')!r})\n"
        "    sys.modules['nestling.stray'] = importlib.util.module_from_spec(spec)\n"
    )
    tree = _fake_tree(tmp_path / "tree", '"nestling.server" = "srv"', smuggle)
    done = _bootstrap(tree)
    assert done.returncode == 3, done.stdout + done.stderr
    assert f"nestling.stray: {tmp_path / 'elsewhere.py'}" in done.stderr
