"""A restricted unpickler for dataset files that only rebuilds numpy arrays, never arbitrary objects."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from nestling.errors import DataError


def _reconstruct(subtype: type, shape: Any, dtype: Any) -> np.ndarray:
    """Stand-in for numpy's `_reconstruct`: only plain ndarrays, so no subclass constructor can run."""
    if subtype is not np.ndarray:
        raise pickle.UnpicklingError(f"array subtype {subtype!r} is not allowed")
    return np.ndarray.__new__(np.ndarray, shape, dtype)


def _frombuffer(buffer: Any, dtype: Any, shape: Any, order: str) -> np.ndarray:
    """Stand-in for numpy's protocol-5 `_frombuffer`: copy the bytes into a fresh array."""
    array = np.frombuffer(bytes(buffer), dtype=np.dtype(dtype))
    return array.reshape(shape, order="F" if order == "F" else "C").copy(order="K")


def _latin1_encode(text: str, encoding: str = "utf-8") -> bytes:
    """Stand-in for `_codecs.encode`, which protocol-2 pickles use to carry bytes; latin1 only."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(f"_codecs.encode with {encoding!r} is not allowed")
    return text.encode("latin1")


# The only globals a pickled dict of numpy arrays refers to (numpy 1.x and 2.x module names; protocol 2
# carries bytes through `_codecs.encode`, protocol 5 arrays through `_frombuffer`). Anything else
# (os.system, builtins.eval, ...) is refused.
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy.core.numeric", "_frombuffer"): _frombuffer,
    ("numpy._core.numeric", "_frombuffer"): _frombuffer,
    ("_codecs", "encode"): _latin1_encode,
}


class NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickler whose `find_class` knows only the numpy array constructors."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED_GLOBALS.get((module, name))
        if allowed is None:
            raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in a dataset file")
        return allowed


def load_numpy_pickle(path: Path) -> Any:
    """Unpickle a dataset file (e.g. CIFAR's python batches) allowing nothing but numpy arrays and builtins.

    latin1 decoding is what the original Python 2 CIFAR pickles need for their byte strings.
    """
    try:
        payload = path.read_bytes()
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err})") from err
    try:
        return NumpyOnlyUnpickler(io.BytesIO(payload), encoding="latin1").load()
    except pickle.UnpicklingError as err:
        raise DataError(f"{path}: refused to unpickle ({err})") from err
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError, OverflowError) as err:
        raise DataError(f"{path}: malformed pickle ({type(err).__name__}: {err})") from err
