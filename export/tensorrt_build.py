"""TensorRT engines from the exported ONNX: fp32/fp16, and int8 from the symmetric QDQ graph.

Int8 uses explicit quantization: the QDQ graph that `export.quantize` calibrates on the same real
images as the ONNX Runtime int8 model (TensorRT 10 deprecates implicit calibrators). On a Jetson with
`trtexec` on the PATH the engine is built by trtexec, elsewhere by the Python builder API. Engines are
specific to the GPU and TensorRT version that built them: build on the board that runs them.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from nestling.errors import ConfigError, DependencyError, SpecError

TENSORRT_HINT = (
    "TensorRT export needs tensorrt and an NVIDIA GPU: pip install nestling[tensorrt] "
    "on a machine with an NVIDIA GPU"
)
PRECISIONS = ("fp32", "fp16", "int8")
BUILDERS = ("auto", "api", "trtexec")
JETSON_RELEASE_FILE = Path("/etc/nv_tegra_release")


@dataclass(frozen=True)
class TensorRTConfig:
    """What engine to build: precision, batch range of its optimisation profile, workspace, builder."""

    precision: str = "fp16"
    min_batch: int = 1
    opt_batch: int = 1
    max_batch: int = 32
    workspace_mb: int = 1024
    builder: str = "auto"  # auto: trtexec on a Jetson when it is on the PATH, else the Python API

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"[export] unknown TensorRT precision '{self.precision}' (known: {', '.join(PRECISIONS)})"
            )
        if not 1 <= self.min_batch <= self.opt_batch <= self.max_batch:
            raise ConfigError(
                f"[export] TensorRT batches must satisfy 1 <= min <= opt <= max, got "
                f"{self.min_batch}, {self.opt_batch}, {self.max_batch}"
            )
        if self.workspace_mb < 1:
            raise ConfigError(f"[export] TensorRT workspace must be >= 1 MiB, got {self.workspace_mb}")
        if self.builder not in BUILDERS:
            raise ConfigError(
                f"[export] unknown TensorRT builder '{self.builder}' (known: {', '.join(BUILDERS)})"
            )

    def profile_shapes(self, input_shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """(min, opt, max) input shapes of the engine's optimisation profile."""
        return tuple((batch, *input_shape) for batch in (self.min_batch, self.opt_batch, self.max_batch))

    def use_trtexec(self) -> bool:
        if self.builder == "trtexec":
            return True
        return self.builder == "auto" and JETSON_RELEASE_FILE.exists() and shutil.which("trtexec") is not None


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def require_tensorrt() -> ModuleType:
    """The tensorrt module, or DependencyError with the one line saying what is needed."""
    try:
        import tensorrt
    except ImportError:
        raise DependencyError(TENSORRT_HINT) from None
    if not _cuda_available():
        raise DependencyError(TENSORRT_HINT)
    return tensorrt


def trtexec_command(
    onnx_path: Path, plan_path: Path, config: TensorRTConfig, input_name: str, input_shape: tuple[int, ...]
) -> list[str]:
    """The trtexec invocation that builds the same engine as the Python API path."""
    shapes = ["x".join(str(d) for d in shape) for shape in config.profile_shapes(input_shape)]
    command = [
        "trtexec",
        f"--onnx={onnx_path}",
        f"--saveEngine={plan_path}",
        f"--minShapes={input_name}:{shapes[0]}",
        f"--optShapes={input_name}:{shapes[1]}",
        f"--maxShapes={input_name}:{shapes[2]}",
        f"--memPoolSize=workspace:{config.workspace_mb}M",
        "--skipInference",
    ]
    if config.precision == "fp16":
        command.append("--fp16")
    elif config.precision == "int8":
        command.append("--int8")
    return command


def build_engine(
    onnx_path: Path, plan_path: Path, config: TensorRTConfig, input_name: str, input_shape: tuple[int, ...]
) -> Path:
    """Build and serialise the engine of `onnx_path` (for int8: the symmetric QDQ graph) to `plan_path`."""
    trt = require_tensorrt()
    if config.use_trtexec():
        done = subprocess.run(
            trtexec_command(onnx_path, plan_path, config, input_name, input_shape),
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise SpecError(f"trtexec could not build the engine: {' | '.join(tail)}")
        return plan_path
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_path.read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise SpecError(f"TensorRT cannot parse {onnx_path.name}: {errors}")
    builder_config = builder.create_builder_config()
    builder_config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, config.workspace_mb << 20)
    if config.precision == "fp16":
        builder_config.set_flag(trt.BuilderFlag.FP16)
    elif config.precision == "int8":
        builder_config.set_flag(trt.BuilderFlag.INT8)
    profile = builder.create_optimization_profile()
    profile.set_shape(input_name, *config.profile_shapes(input_shape))
    builder_config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, builder_config)
    if serialized is None:
        raise SpecError(f"TensorRT could not build a {config.precision} engine from {onnx_path.name}")
    plan_path.write_bytes(bytes(serialized))
    return plan_path


class EngineRunner:
    """Runs a serialised engine on numpy batches (buffers are torch CUDA tensors), for parity and latency."""

    def __init__(self, plan_path: Path) -> None:
        trt = require_tensorrt()
        import torch

        self._torch = torch
        self._trt = trt
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = runtime.deserialize_cuda_engine(plan_path.read_bytes())
        if self.engine is None:
            raise SpecError(f"{plan_path.name} is not an engine this GPU and TensorRT version can load")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]

    def _dtype(self, name: str) -> Any:
        return (
            self._torch.float16
            if self.engine.get_tensor_dtype(name) == self._trt.float16
            else self._torch.float32
        )

    def __call__(self, x: np.ndarray) -> list[np.ndarray]:
        torch = self._torch
        device_input = torch.from_numpy(np.ascontiguousarray(x)).to("cuda", dtype=self._dtype(self.inputs[0]))
        self.context.set_input_shape(self.inputs[0], tuple(x.shape))
        self.context.set_tensor_address(self.inputs[0], device_input.data_ptr())
        outputs = []
        for name in self.outputs:
            tensor = torch.empty(
                tuple(self.context.get_tensor_shape(name)), dtype=self._dtype(name), device="cuda"
            )
            self.context.set_tensor_address(name, tensor.data_ptr())
            outputs.append(tensor)
        # The current stream orders the engine after the host-to-device copy above, without extra events.
        stream = torch.cuda.current_stream()
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise SpecError("TensorRT engine execution failed")
        stream.synchronize()
        return [t.float().cpu().numpy() for t in outputs]
