"""matplotlib's pyplot on the file-only Agg backend, imported when a plot is drawn, not when a module loads.

Importing pyplot takes about a second; every `nestling` command imports the strategies and the run report, and
most never plot (a board's agent, `nestling infer`, each simulation's pool workers)."""

from __future__ import annotations

from types import ModuleType


def pyplot() -> ModuleType:
    """`matplotlib.pyplot`, on the Agg backend (plots go to files; no display is assumed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
