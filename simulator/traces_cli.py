"""`nestling traces generate|import`: make a fleet trace from the catalogue, or import FedScale's."""

from __future__ import annotations

from nestling.errors import ConfigError


def traces_main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("generate", "import"):
        raise ConfigError("usage: nestling traces generate|import [options] (see --help of each)")
    if argv[0] == "generate":
        from nestling.simulator.generate import traces_generate_main

        return traces_generate_main(argv[1:])
    from nestling.simulator.fedscale_import import traces_import_main

    return traces_import_main(argv[1:])
