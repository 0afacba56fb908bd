"""Exact training-memory accounting: bytes autograd saves for backward, parameter/gradient/optimizer bytes, RSS."""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Iterable, Iterator
from types import TracebackType

import psutil
import torch
from torch import nn


def storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the storage behind a tensor: two views of one buffer share it."""
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class SavedTensorMeter:
    """Counts what autograd keeps for backward, once per storage (a tensor saved by two ops counts once).

    Parameters and buffers are excluded (they are counted as parameters); `label` attributes every
    saved storage to the part of the model running when it was saved, so a storage saved by two parts
    (a block's output kept by its last ReLU and by the next block's first conv) appears in both parts
    but once in `total_bytes`. Use one meter per forward pass: storages freed by backward may be reused.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {storage_key(t)[0] for t in exclude}
        self._sizes: dict[int, int] = {}
        self._by_label: dict[str, dict[int, int]] = {}
        self.label = "other"
        self._hooks: contextlib.AbstractContextManager[None] | None = None

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        address, nbytes = storage_key(tensor)
        if address and address not in self._excluded:
            self._sizes[address] = nbytes
            self._by_label.setdefault(self.label, {})[address] = nbytes
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def __enter__(self) -> SavedTensorMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(kind, error, trace)

    @contextlib.contextmanager
    def part(self, label: str) -> Iterator[None]:
        previous, self.label = self.label, label
        try:
            yield
        finally:
            self.label = previous

    def attach(self, parts: Iterable[tuple[str, nn.Module]]) -> list[torch.utils.hooks.RemovableHandle]:
        """Label by module: each module's forward pre-hook switches the label to its name."""
        handles = []
        for name, module in parts:

            def enter(_module: nn.Module, _inputs: tuple[object, ...], name: str = name) -> None:
                self.label = name

            handles.append(module.register_forward_pre_hook(enter))
        return handles

    @property
    def total_bytes(self) -> int:
        return sum(self._sizes.values())

    def bytes_of(self, label: str) -> int:
        return sum(self._by_label.get(label, {}).values())

    def shared_bytes(self, first: str, second: str) -> int:
        """Bytes of storages saved under both labels."""
        a, b = self._by_label.get(first, {}), self._by_label.get(second, {})
        return sum(size for key, size in a.items() if key in b)

    def labels(self) -> list[str]:
        return list(self._by_label)


def model_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers: what a meter must not count as activations."""
    return [*module.parameters(), *module.buffers()]


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors))


def parameter_bytes(module: nn.Module) -> int:
    """Parameters and buffers (running statistics) of a module."""
    return tensor_bytes(model_tensors(module))


def gradient_bytes(params: Iterable[nn.Parameter]) -> int:
    return tensor_bytes(p.grad for p in params if p.grad is not None)


def optimizer_bytes(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter] | None = None) -> int:
    """Tensors the optimizer keeps per parameter (SGD: the momentum buffer), optionally for a subset."""
    wanted = None if params is None else {id(p) for p in params}
    total = 0
    for param, state in optimizer.state.items():
        if wanted is not None and id(param) not in wanted:
            continue
        total += tensor_bytes(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total


def rss_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


_M_MMAP_THRESHOLD = -3


def return_freed_memory_to_os(threshold: int = 64 * 1024) -> bool:
    """Ask glibc to serve every allocation above `threshold` by mmap, so freed tensors leave RSS at once.

    Without it glibc's dynamic threshold keeps freed tensor memory in the heap and an RSS difference
    says nothing about what a step held. Returns False where this is not glibc (the RSS cross-check is
    then only indicative)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
        libc.malloc_trim(0)  # hand back what the heap already holds from earlier allocations
        return ok
    except (OSError, AttributeError):
        return False
