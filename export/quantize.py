"""Static int8 quantization (QDQ) of an exported graph with onnxruntime, calibrated on real images."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quant_pre_process,
    quantize_static,
)

from nestling.export.calibration import CalibrationBatches
from nestling.export.onnx_export import INPUT_NAME, check_onnx

CALIBRATION_METHODS = {
    "minmax": CalibrationMethod.MinMax,
    "entropy": CalibrationMethod.Entropy,
    "percentile": CalibrationMethod.Percentile,
}


@dataclass(frozen=True)
class Int8Options:
    """How to quantize. `symmetric` gives signed activations with zero point 0: what TensorRT's explicit
    quantization accepts; the ORT CPU default keeps unsigned asymmetric activations (uint8 after ReLU
    uses the full range) and signed per-channel weights (U8S8, the VNNI-friendly pairing)."""

    method: str = "minmax"
    per_channel: bool = True
    symmetric: bool = False

    def describe(self) -> dict[str, object]:
        return {
            "format": "QDQ",
            "calibration": self.method,
            "per_channel": self.per_channel,
            "activations": "int8-symmetric" if self.symmetric else "uint8-asymmetric",
            "weights": "int8",
        }


class _Reader(CalibrationDataReader):
    """Feeds the calibration batches to onnxruntime's calibrator, once."""

    def __init__(self, batches: CalibrationBatches, input_name: str) -> None:
        self.input_name = input_name
        self.batches = batches
        self._iter: Iterator[np.ndarray] | None = None

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._iter is None:
            self._iter = iter(self.batches)
        batch = next(self._iter, None)
        return None if batch is None else {self.input_name: batch}

    def rewind(self) -> None:
        self._iter = None


def quantize_int8(
    fp32_path: Path, out_path: Path, batches: CalibrationBatches, options: Int8Options = Int8Options()
) -> Path:
    """Write the int8 QDQ model of `fp32_path` to `out_path` (pre-processed: shape inference, fusions)."""
    extra = {"ActivationSymmetric": options.symmetric, "WeightSymmetric": True}
    with tempfile.TemporaryDirectory(prefix="nestling-int8-") as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        quant_pre_process(str(fp32_path), str(prepared), skip_symbolic_shape=True)
        quantize_static(
            str(prepared),
            str(out_path),
            _Reader(batches, INPUT_NAME),
            quant_format=QuantFormat.QDQ,
            per_channel=options.per_channel,
            activation_type=QuantType.QInt8 if options.symmetric else QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=CALIBRATION_METHODS[options.method],
            extra_options=extra,
        )
    check_onnx(out_path)
    return out_path
