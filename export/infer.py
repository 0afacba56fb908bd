"""`nestling infer --bundle DIR INPUT...`: run an export bundle with onnxruntime, numpy and msgspec only (no PyTorch).

INPUT is an image file (read with Pillow, resized to the bundle's input size, normalised with the
bundle's mean/std) or a .npy array: uint8 arrays are pixels, (H, W, C) or (N, H, W, C), normalised
like images; float arrays are model input already normalised, (C, H, W) or (N, C, H, W).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nestling.cli_numbers import positive_int
from nestling.errors import DataError, DependencyError, NestlingError
from nestling.export.bundle import read_bundle
from nestling.strict_json import strict_dumps


@dataclass
class Prediction:
    input: str
    index: int
    label: str
    probability: float
    top: list[tuple[str, float]]


class BundleRunner:
    """An onnxruntime session over one of a verified bundle's models, with the bundle's input contract."""

    def __init__(self, folder: Path, model: str | None = None, threads: int = 1) -> None:
        try:
            import onnxruntime as ort
        except ImportError:
            raise DependencyError("nestling infer needs onnxruntime: pip install onnxruntime") from None
        self.folder = Path(folder)
        self.manifest = read_bundle(self.folder)  # refuses files that do not match their sha256
        models = self.manifest["models"]
        self.model = model or self.manifest["default_model"]
        if self.model not in models:
            raise DataError(f"bundle has no '{self.model}' model (has: {', '.join(models)})")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(
            str(self.folder / models[self.model]["file"]), options, providers=["CPUExecutionProvider"]
        )
        spec = self.manifest["input"]
        self.input_name: str = spec["name"]
        self.channels, self.height, self.width = (int(d) for d in spec["shape"][1:])
        self.normalization: dict[str, Any] | None = spec.get("normalization")
        self.class_names: list[str] = list(self.manifest.get("class_names") or [])
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, x: np.ndarray, output: str | None = None, batch_size: int = 64) -> np.ndarray:
        """Logits of one output (default: the bundle's) for normalised float32 input (N, C, H, W)."""
        name = output or self.manifest["default_output"]
        if name not in self.output_names:
            raise DataError(f"bundle has no output '{name}' (has: {', '.join(self.output_names)})")
        expected = (self.channels, self.height, self.width)
        if x.ndim != 4 or tuple(x.shape[1:]) != expected:
            raise DataError(
                f"input of shape {x.shape} does not match the bundle's (N, {', '.join(map(str, expected))})"
            )
        chunks = [
            self.session.run(
                [name], {self.input_name: np.ascontiguousarray(x[i : i + batch_size], np.float32)}
            )[0]
            for i in range(0, len(x), batch_size)
        ]
        return np.concatenate(chunks)

    # -- inputs ----------------------------------------------------------------------------------
    def normalise_pixels(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 (N, H, W, C) pixels → normalised float32 (N, C, H, W) with the bundle's mean/std."""
        if self.normalization is None:
            raise DataError(
                "this bundle records no input normalisation: give normalised float .npy arrays, "
                "not images or uint8 pixels"
            )
        scale = float(self.normalization.get("pixel_scale", 255.0))
        mean = np.asarray(self.normalization["mean"], np.float32).reshape(1, -1, 1, 1)
        std = np.asarray(self.normalization["std"], np.float32).reshape(1, -1, 1, 1)
        x = pixels.astype(np.float32).transpose(0, 3, 1, 2) / scale
        return (x - mean) / std

    def load(self, path: Path) -> np.ndarray:
        """One input file as a normalised (N, C, H, W) float32 batch."""
        if path.suffix.lower() == ".npy":
            array = np.load(path, allow_pickle=False)
            if array.dtype == np.uint8:
                pixels = array if array.ndim == 4 else array[None]
                if (
                    pixels.ndim == 4
                    and pixels.shape[-1] != self.channels
                    and pixels.shape[1] == self.channels
                ):
                    raise DataError(f"{path}: uint8 pixels must be channels-last (N, H, W, C)")
                return self.normalise_pixels(pixels)
            if not np.issubdtype(array.dtype, np.floating):
                raise DataError(f"{path}: expected uint8 pixels or float model input, got {array.dtype}")
            return (array if array.ndim == 4 else array[None]).astype(np.float32)
        return self.normalise_pixels(self._read_image(path)[None])

    def _read_image(self, path: Path) -> np.ndarray:
        try:
            from PIL import Image
        except ImportError:
            raise DependencyError(
                "reading images needs Pillow: pip install pillow (or give .npy arrays)"
            ) from None
        try:
            with Image.open(path) as opened:
                image = opened.convert("RGB" if self.channels == 3 else "L")
            if image.size != (self.width, self.height):
                image = image.resize((self.width, self.height), Image.Resampling.BILINEAR)
            pixels = np.asarray(image, dtype=np.uint8)
        except OSError as exc:
            raise DataError(f"cannot read image {path}: {exc}") from None
        return pixels if pixels.ndim == 3 else pixels[..., None]

    def label(self, index: int) -> str:
        return self.class_names[index] if index < len(self.class_names) else str(index)


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=-1, keepdims=True)


def predict(
    runner: BundleRunner, inputs: list[Path], *, output: str | None = None, top: int = 1
) -> list[Prediction]:
    """Top-1 (and top-k) prediction of every sample in every input file."""
    predictions: list[Prediction] = []
    for path in inputs:
        if not path.is_file():
            raise DataError(f"input {path} does not exist")
        probs = softmax(runner.run(runner.load(path), output).astype(np.float64))
        for i, row in enumerate(probs):
            order = np.argsort(-row)[: max(1, top)]
            name = str(path) if len(probs) == 1 else f"{path}[{i}]"
            predictions.append(
                Prediction(
                    name,
                    int(order[0]),
                    runner.label(int(order[0])),
                    float(row[order[0]]),
                    [(runner.label(int(k)), float(row[k])) for k in order],
                )
            )
    return predictions


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nestling infer", description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, required=True, help="export bundle folder (with bundle.json)")
    parser.add_argument("inputs", type=Path, nargs="+", metavar="INPUT", help="image files or .npy arrays")
    parser.add_argument(
        "--model", help="which model of the bundle to run (fp32, int8; default: the bundle's)"
    )
    parser.add_argument("--output", help="graph output to read (bundles exported with --all-exits)")
    parser.add_argument("--top", type=positive_int, default=1, help="classes to list per input")
    parser.add_argument("--threads", type=positive_int, default=1, help="onnxruntime intra-op threads")
    parser.add_argument("--json", action="store_true", help="print predictions as JSON")
    return parser


def infer_main(argv: list[str]) -> int:
    """CLI entry of `nestling infer`; returns the process exit code."""
    args = _parser().parse_args(argv)
    try:
        runner = BundleRunner(args.bundle, args.model, args.threads)
        predictions = predict(runner, list(args.inputs), output=args.output, top=args.top)
    except NestlingError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2  # as every nestling command: 2 is a refused input, never a crash
    if args.json:
        print(strict_dumps([asdict(p) for p in predictions], indent=1))
    else:
        for p in predictions:
            extra = "  ".join(f"{label} {prob:.3f}" for label, prob in p.top[1:])
            print(f"{p.input}\t{p.index}\t{p.label}\t{p.probability:.4f}" + (f"\t{extra}" if extra else ""))
    return 0


if __name__ == "__main__":
    sys.exit(infer_main(sys.argv[1:]))
