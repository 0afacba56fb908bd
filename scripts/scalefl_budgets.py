"""Print how ScaleFL's levels spend their parameters on ResNet-20/56/110: backbone vs exit heads.

Used by docs/reproductions.md to explain why ScaleFL trails HeteroFL on ResNet-20 at equal parameters.
Run: python scripts/scalefl_budgets.py [--levels 0.125,0.25,0.5,1]
"""

from __future__ import annotations

import argparse

import numpy as np

from nestling.models import ModelConfig
from nestling.server.strategies.scalefl_split import level_budgets, search_levels
from nestling.slicing import shapes_for
from nestling.spec import SubmodelSpec

DEPTHS = {"resnet20": 9, "resnet56": 27, "resnet110": 54}


def width_only_params(model: ModelConfig, fraction: float) -> int:
    """Parameters of the width-only submodel (HeteroFL's, at width √fraction, every block and the head)."""
    shapes = shapes_for(SubmodelSpec(model.with_(exit_points=()), width=fraction**0.5))
    return sum(int(np.prod(shape)) for shape in shapes.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="0.125,0.25,0.5,1", help="parameter fractions, the last 1")
    fractions = tuple(float(f) for f in parser.parse_args().levels.split(","))
    print(
        "| model | level | width | blocks kept | backbone params | exit params | exit share | "
        "width-only model at this fraction |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for arch, blocks in DEPTHS.items():
        model = ModelConfig(arch, exit_kind="scalefl", scaler="always", norm_stats="batch", rounding="floor")
        levels = search_levels(model, fractions, num_blocks=blocks)
        for number, budget in enumerate(level_budgets(model, levels, num_blocks=blocks), start=1):
            level = budget.level
            print(
                f"| {arch} | {number} ({fractions[number - 1]:g}) | {level.width:.2f} | {level.depth}/{blocks} | "
                f"{budget.backbone:,} | {budget.exits:,} | {budget.exit_share:.0%} | "
                f"{width_only_params(model, fractions[number - 1]):,} |"
            )


if __name__ == "__main__":
    main()
