"""A bundle from elsewhere (a board) is read defensively: malformed manifests and symbolic links are refused by name."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from nestling.errors import DataError
from nestling.export.bundle import MANIFEST_NAME, read_bundle, write_bundle
from nestling.export.infer import infer_main


def make_bundle(folder: Path) -> Path:
    """A bundle as `export` writes one (its model file's content does not matter to reading it)."""
    folder.mkdir()
    (folder / "model.onnx").write_bytes(b"not really onnx")
    manifest = {
        "models": {"fp32": {"file": "model.onnx"}},
        "default_model": "fp32",
        "default_output": "logits",
        "input": {
            "name": "input",
            "shape": ["batch", 3, 8, 8],
            "normalization": {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25], "pixel_scale": 255.0},
        },
        "class_names": ["a", "b"],
        "parity": {},
    }
    write_bundle(folder, manifest, ["model.onnx"])
    return folder


def edit(folder: Path, change: Callable[[dict], object]) -> None:
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    change(manifest)
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_a_bundle_as_written_is_read(tmp_path: Path) -> None:
    assert read_bundle(make_bundle(tmp_path / "b"))["default_model"] == "fp32"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda m: m.update(models={"fp32": "model.onnx"}), r"models"),
        (lambda m: m.update(models={"fp32": {"path": "model.onnx"}}), r"file"),
        (lambda m: m.update(files=["model.onnx"]), r"files"),
        (lambda m: m["files"].update({"model.onnx": 5}), r"files"),
        (lambda m: m["input"].update(shape=["batch", "3", 8, 8]), r"input.shape"),
        (lambda m: m["input"].update(shape=[1, 3, 8]), r"input.shape"),
        (lambda m: m["input"]["normalization"].update(std=[0.0, 1.0, 1.0]), r"normalization.std"),
        (lambda m: m["input"]["normalization"].update(mean=[0.5, 0.5]), r"normalization"),
        (lambda m: m.update(default_model="int8"), r"default model"),
        (lambda m: m.pop("input"), r"input"),
        (lambda m: m.update(class_names="ab"), r"class_names"),
        (lambda m: m.update(format="1"), r"bundle format"),
    ],
)
def test_a_malformed_manifest_is_refused_naming_what_is_wrong(tmp_path: Path, capsys, change, named) -> None:
    folder = make_bundle(tmp_path / "b")
    edit(folder, change)
    with pytest.raises(DataError, match=named):
        read_bundle(folder)
    assert infer_main(["--bundle", str(folder), str(tmp_path / "x.npy")]) == 2
    assert "DataError" in capsys.readouterr().err


def test_a_manifest_that_is_not_an_object_is_refused(tmp_path: Path) -> None:
    folder = make_bundle(tmp_path / "b")
    for text in ("[1, 2]", "null", "{" * 100_000, "\udcff"):
        (folder / MANIFEST_NAME).write_text(text, errors="surrogateescape")
        with pytest.raises(DataError):
            read_bundle(folder)


def test_a_symlinked_model_file_never_passes_its_sha256_check(tmp_path: Path) -> None:
    """The link points at a file with exactly the hashed content: it is still refused, before hashing."""
    folder = make_bundle(tmp_path / "b")
    elsewhere = tmp_path / "elsewhere.onnx"
    elsewhere.write_bytes((folder / "model.onnx").read_bytes())
    (folder / "model.onnx").unlink()
    (folder / "model.onnx").symlink_to(elsewhere)
    with pytest.raises(DataError, match="symbolic link"):
        read_bundle(folder)


def test_a_symlinked_manifest_or_folder_inside_is_refused(tmp_path: Path) -> None:
    folder = make_bundle(tmp_path / "b")
    moved = tmp_path / "manifest.json"
    (folder / MANIFEST_NAME).rename(moved)
    (folder / MANIFEST_NAME).symlink_to(moved)
    with pytest.raises(DataError, match="symbolic link"):
        read_bundle(folder)
    other = make_bundle(tmp_path / "c")
    (other / "sub").symlink_to(tmp_path / "b")
    edit(
        other,
        lambda m: m.update(
            files={"sub/model.onnx": m["files"]["model.onnx"]}, models={"fp32": {"file": "sub/model.onnx"}}
        ),
    )
    with pytest.raises(DataError, match="symbolic link"):
        read_bundle(other)
