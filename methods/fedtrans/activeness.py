"""Which cells to grow: activeness from the server's aggregated updates (METHODS §4.a.2 step 8b-c).

act_l = ‖ḡ_l‖₂ / ‖w_l‖₂ with ḡ_l the mean over the last T_act rounds of the aggregated (server-side) update of
cell l's trained parameters (never per-client gradients); BN running statistics are state, not weights, and
are left out. Cells with act_l ≥ α·max act are selected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from nestling.errors import ConfigError
from nestling.methods.fedtrans.cells import cell_of_key, is_statistic


def cell_activeness(
    updates: Sequence[Mapping[str, torch.Tensor]], weights: Mapping[str, torch.Tensor], window: int = 5
) -> list[float]:
    """act_l of every cell of the model whose current `weights` and per-round aggregated `updates` are given.

    Uses the last `window` updates (fewer while the model is younger than T_act rounds; at least one).
    """
    if window < 1:
        raise ConfigError(f"the activeness window T_act must be >= 1, got {window}")
    recent = list(updates)[-window:]
    if not recent:
        raise ConfigError("cell activeness needs at least one round of aggregated updates")
    cells = sorted({c for k in weights if (c := cell_of_key(k)) is not None})
    update_norm = dict.fromkeys(cells, 0.0)
    weight_norm = dict.fromkeys(cells, 0.0)
    for key, tensor in weights.items():
        cell = cell_of_key(key)
        if cell is None or is_statistic(key) or not tensor.is_floating_point():
            continue
        missing = [n for n, u in enumerate(recent) if key not in u or u[key].shape != tensor.shape]
        if missing:
            raise ConfigError(
                f"aggregated updates {missing} do not hold {key} with shape {tuple(tensor.shape)}"
            )
        mean_update = torch.stack([u[key].double() for u in recent]).mean(dim=0)
        update_norm[cell] += float(mean_update.square().sum())
        weight_norm[cell] += float(tensor.double().square().sum())
    return [(update_norm[c] ** 0.5) / (weight_norm[c] ** 0.5) if weight_norm[c] > 0 else 0.0 for c in cells]


def select_cells(activeness: Sequence[float], alpha: float = 0.9) -> list[int]:
    """Cells with act ≥ α·max act (every cell when none moved, so a transformation still grows the model)."""
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"the cell-selection threshold alpha must be in [0, 1], got {alpha}")
    if not activeness:
        raise ConfigError("no cell activeness given")
    top = max(activeness)
    return [cell for cell, act in enumerate(activeness) if act >= alpha * top]
