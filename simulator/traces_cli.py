"""`nestling traces generate|import`: make a fleet trace from the catalogue, or import FedScale's."""

from __future__ import annotations

import argparse


def traces_main(argv: list[str]) -> int:
    """Dispatch to the verb's own parser; `nestling traces --help` lists the verbs."""
    parser = argparse.ArgumentParser(
        prog="nestling traces",
        description="Make a device trace file for `nestling simulate --traces` (docs/traces.md).",
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    verbs.add_parser("generate", help="a synthetic fleet from the board catalogue", add_help=False)
    verbs.add_parser("import", help="FedScale's device capacity and behaviour traces", add_help=False)
    if not argv or argv[0] not in ("generate", "import"):
        parser.parse_args(argv)  # --help prints the verbs and exits 0; anything else exits 2 with the usage
    if argv[0] == "generate":
        from nestling.simulator.generate import traces_generate_main

        return traces_generate_main(argv[1:])
    from nestling.simulator.fedscale_import import traces_import_main

    return traces_import_main(argv[1:])
