"""Named local training procedures; a Task names one and the board runs it on its own data."""

from nestling.edge.procedures import depthwise as _depthwise  # noqa: F401
from nestling.edge.procedures import distill as _distill  # noqa: F401
from nestling.edge.procedures import dynamicfl as _dynamicfl  # noqa: F401
from nestling.edge.procedures import fjord as _fjord  # noqa: F401

# Importing the modules registers their procedures.
from nestling.edge.procedures import plain as _plain  # noqa: F401
from nestling.edge.procedures.registry import (
    ClientData,
    DeviceStore,
    LocalOutcome,
    check_hparams,
    get_procedure,
    is_batchable,
    known_procedures,
    register,
    register_procedure,
    unregister_procedure,
)

__all__ = [
    "ClientData",
    "DeviceStore",
    "LocalOutcome",
    "check_hparams",
    "get_procedure",
    "is_batchable",
    "known_procedures",
    "register",
    "register_procedure",
    "unregister_procedure",
]
