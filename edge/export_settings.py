"""agent.toml's [export] table: whether this board builds its own deployable when a run ends, and how.

Kept apart from the agent's other settings because only the end-of-run export (edge/board_export.py)
reads it; the agent itself only advertises `on_finish` and the wanted format in its hello.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nestling.errors import ConfigError

FORMATS = ("onnx", "tensorrt")
PRECISIONS = ("fp32", "fp16", "int8")
QUANTIZE = ("none", "int8")
CALIB_DATA = ("dataset", "none")


@dataclass
class ExportSection:
    on_finish: bool = False  # ask the server for the final model of this board's submodel when the run ends
    format: str = "onnx"  # "tensorrt": also build a TensorRT engine when tensorrt and a CUDA GPU are present
    precision: str = "fp16"  # TensorRT engine precision
    quantize: str = "none"  # "int8": add an onnxruntime int8 model (needs calib_data = "dataset")
    out_dir: str | None = (
        None  # the bundle folder (replaced by each run); default ~/.nestling/bundles/<fleet>/<id>
    )
    calib_data: str = "dataset"  # "dataset": [data]'s dataset for calibration, real-input parity and accuracy
    calib_samples: int = 256  # training images for static BN / int8 calibration
    eval_samples: int = 500  # held-out test images for real-input parity and accuracy

    def check(self) -> None:
        for value, known, key in (
            (self.format, FORMATS, "format"),
            (self.precision, PRECISIONS, "precision"),
            (self.quantize, QUANTIZE, "quantize"),
            (self.calib_data, CALIB_DATA, "calib_data"),
        ):
            if value not in known:
                raise ConfigError(f"[export] {key} must be one of {', '.join(known)}, got {value!r}")
        if self.calib_samples < 1 or self.eval_samples < 1:
            raise ConfigError("[export] calib_samples and eval_samples must be >= 1")
        if self.quantize == "int8" and self.calib_data == "none":
            raise ConfigError(
                '[export] quantize = "int8" needs calibration images: set calib_data = "dataset"'
            )

    def resolve(self, base: Path) -> ExportSection:
        """Relative out_dir taken from the config file's folder (absolute and ~ paths stay)."""
        if self.out_dir is not None:
            self.out_dir = str(base / Path(self.out_dir).expanduser())
        return self

    def bundle_dir(self, fleet: str, device_id: str) -> Path:
        if self.out_dir is not None:
            return Path(self.out_dir)
        return Path.home() / ".nestling" / "bundles" / fleet / device_id

    def advertised(self) -> dict[str, Any] | None:
        """What the hello says: {"on_finish": true, "format": ...}, or None when the board does not ask."""
        return {"on_finish": True, "format": self.format} if self.on_finish else None
