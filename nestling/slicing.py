"""Map each submodel tensor to the index region of the global tensor it comes from (METHODS §1.1).

Slicing is ordered (leading channels), so a submodel tensor of shape (a, b, ...) is exactly the
global region [:a, :b, ...]: the regions come from the submodel's shapes, built once on the meta
device and cached by spec id. Extraction and scatter are pure indexing.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from nestling.errors import SpecError
from nestling.models.roles import roles_of
from nestling.models.zoo import build
from nestling.packed import pack
from nestling.spec import SubmodelSpec

Region = tuple[slice, ...]


@lru_cache(maxsize=512)
def _shapes_and_roles(spec: SubmodelSpec) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    net = build(spec, device="meta")
    shapes = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    return shapes, roles_of(net)


def shapes_for(spec: SubmodelSpec) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor in `build(spec).state_dict()`, without allocating it."""
    return dict(_shapes_and_roles(spec)[0])


def roles_for(spec: SubmodelSpec) -> dict[str, str]:
    """Role of every tensor as its module declared it (nestling.models.roles): 'norm' (BN params and buffers),
    'layer_norm', 'step' (step sizes) or, undeclared, 'weight'."""
    return dict(_shapes_and_roles(spec)[1])


def slices_for(spec: SubmodelSpec) -> dict[str, Region]:
    """Region of the global tensor that each submodel tensor occupies."""
    return {k: tuple(slice(0, n) for n in shape) for k, shape in _shapes_and_roles(spec)[0].items()}


def check_compatible(global_state: dict[str, torch.Tensor], spec: SubmodelSpec) -> None:
    """Raise SpecError unless every tensor of `spec` fits inside the global state."""
    for key, shape in _shapes_and_roles(spec)[0].items():
        if key not in global_state:
            raise SpecError(f"submodel tensor '{key}' has no counterpart in the global model")
        global_shape = tuple(global_state[key].shape)
        if len(global_shape) != len(shape) or any(s > g for s, g in zip(shape, global_shape)):
            raise SpecError(f"submodel tensor '{key}' {shape} does not fit in global {global_shape}")


def extract(
    global_state: dict[str, torch.Tensor],
    spec: SubmodelSpec,
    *,
    keys: set[str] | None = None,
    copy: bool = True,
) -> dict[str, torch.Tensor]:
    """The submodel's weights out of the global state: a packed copy (nestling/packed.py: one buffer, what
    the update screen subtracts a packed result from) unless `copy=False`, then views of the global tensors."""
    out: dict[str, torch.Tensor] = {}
    for key, region in slices_for(spec).items():
        if keys is not None and key not in keys:
            continue
        out[key] = global_state[key][region]
    return pack(out) if copy else out


def scatter(
    global_state: dict[str, torch.Tensor], sub_state: dict[str, torch.Tensor], spec: SubmodelSpec
) -> None:
    """Write a submodel's tensors back into their global regions, in place."""
    regions = slices_for(spec)
    for key, tensor in sub_state.items():
        region = regions.get(key)
        if region is None:
            raise SpecError(f"tensor '{key}' is not part of submodel {spec.id}")
        global_state[key][region].copy_(tensor)


def check_result_tensors(
    sub_state: dict[str, torch.Tensor], spec: SubmodelSpec, reference: dict[str, torch.Tensor]
) -> None:
    """Validate an uploaded state against its spec: names, shapes, dtypes, finiteness (bad input never lands)."""
    shapes = _shapes_and_roles(spec)[0]
    unknown = sorted(set(sub_state) - set(shapes))
    if unknown:
        raise SpecError(f"result has tensors not in submodel {spec.id}: {unknown[:5]}")
    for key, tensor in sub_state.items():
        if tuple(tensor.shape) != shapes[key]:
            raise SpecError(f"result tensor '{key}' has shape {tuple(tensor.shape)}, expected {shapes[key]}")
        if tensor.dtype != reference[key].dtype:
            raise SpecError(
                f"result tensor '{key}' has dtype {tensor.dtype}, expected {reference[key].dtype}"
            )
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise SpecError(f"result tensor '{key}' contains NaN or Inf")
