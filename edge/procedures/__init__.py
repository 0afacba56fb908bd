"""Named local training procedures; a Task names one and the board runs it on its own data.

Every module of this package is imported here and registers its procedures with `@register` (nestling.discovery):
a new procedure is one module, and a plugin's procedure registers the same way from its own module.
"""

from nestling.discovery import import_modules
from nestling.edge.procedures.registry import (
    ClientData,
    DeviceStore,
    LocalOutcome,
    check_hparams,
    get_procedure,
    is_batchable,
    known_procedures,
    params_for,
    register,
    register_procedure,
    restore_procedures,
    snapshot_procedures,
    unregister_procedure,
)

import_modules(__name__, __path__)

__all__ = [
    "ClientData",
    "DeviceStore",
    "LocalOutcome",
    "check_hparams",
    "get_procedure",
    "is_batchable",
    "known_procedures",
    "params_for",
    "register",
    "register_procedure",
    "restore_procedures",
    "snapshot_procedures",
    "unregister_procedure",
]
