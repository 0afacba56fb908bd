"""ONNX export of a standalone module: dynamic batch axis, checker-clean, optionally simplified (onnxsim)."""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch

from nestling.errors import DependencyError, SpecError
from nestling.export.standalone import StandaloneNet

DEFAULT_OPSET = 17
INPUT_NAME = "input"
BATCH_AXIS = "batch"


@dataclass(frozen=True)
class OnnxResult:
    path: Path
    opset: int
    simplified: bool
    nodes: int
    exporter: str


def export_onnx(
    model: StandaloneNet,
    path: Path,
    input_shape: tuple[int, int, int],
    *,
    opset: int = DEFAULT_OPSET,
    simplify: bool | None = None,
    dynamo: bool = False,
) -> OnnxResult:
    """Write `model` to `path` with input "input" (batch, C, H, W) and one output per `model.output_names`.

    The TorchScript exporter is the default: the standalone graph has no control flow, and it exports
    in a fraction of a second. `dynamo=True` uses torch.export instead. simplify=None simplifies when
    onnxsim is installed; True requires it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    example = torch.zeros(2, *input_shape)
    names = list(model.output_names)
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore", DeprecationWarning
        )  # the TorchScript exporter announces its retirement
        if dynamo:
            batch = torch.export.Dim(BATCH_AXIS, min=1, max=65536)
            torch.onnx.export(
                model,
                (example,),
                str(path),
                dynamo=True,
                input_names=[INPUT_NAME],
                output_names=names,
                dynamic_shapes=({0: batch},),
                opset_version=opset,
                external_data=False,
            )
        else:
            axes = {name: {0: BATCH_AXIS} for name in [INPUT_NAME, *names]}
            torch.onnx.export(
                model,
                (example,),
                str(path),
                dynamo=False,
                input_names=[INPUT_NAME],
                output_names=names,
                dynamic_axes=axes,
                opset_version=opset,
            )
    proto = onnx.load(str(path))
    simplified = False
    if simplify or (simplify is None and importlib.util.find_spec("onnxsim") is not None):
        proto = _simplify(proto)
        onnx.save(proto, str(path))
        simplified = True
    check_onnx(path)
    return OnnxResult(path, opset, simplified, len(proto.graph.node), "dynamo" if dynamo else "torchscript")


def _simplify(proto: onnx.ModelProto) -> onnx.ModelProto:
    try:
        import onnxsim
    except ImportError:
        raise DependencyError("ONNX simplification needs onnxsim: pip install nestling[simplify]") from None
    simplified, ok = onnxsim.simplify(proto)
    if not ok:
        raise SpecError("onnxsim could not validate the simplified graph against the original")
    return simplified


def check_onnx(path: Path) -> None:
    """onnx.checker with full shape inference, plus what the bundle relies on: a dynamic batch axis."""
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    first = proto.graph.input[0].type.tensor_type.shape.dim[0]
    if first.dim_param == "" and first.dim_value != 0:
        raise SpecError(
            f"{path.name}: the input's batch axis is fixed at {first.dim_value}, expected dynamic"
        )
