"""Structural re-parameterisation for DynamicFL (METHODS §5): Diverse Branch Blocks, exact fusion, salience, DYMM.

DynamicFL's own knowledge, shared by the server strategy (pricing a capacity) and the edge procedure (training
the expanded model). The model leaves every public entry point as the plain architecture it came in as.
"""

from nestling.methods.dynamicfl.cost import (
    ExpansionCost,
    affordable_capacity,
    capacity_cost,
    expansion_cost,
    structure_cost,
)
from nestling.methods.dynamicfl.dbb import BRANCHES, DBB4_BRANCHES, ORIGINAL, ConvGeometry, DiverseBranchBlock
from nestling.methods.dynamicfl.expansion import absorb, cut_branches, expand_conv, grow_branches, recalibrate
from nestling.methods.dynamicfl.modulation import (
    CutRule,
    ModulationPlan,
    apply_plan,
    combine_salience,
    current_structure,
    dymm_plan,
    released_plan,
    shrink_structure,
)
from nestling.methods.dynamicfl.rounds import RoundOutcome, TrainEpoch, paper_round, released_round
from nestling.methods.dynamicfl.salience import SalienceMeter, bottom_up, salience, top_salient
from nestling.methods.dynamicfl.sites import (
    ConvSite,
    branch_state,
    expand_model,
    expanded_blocks,
    find_sites,
    fuse_block,
    fuse_model,
)
from nestling.methods.dynamicfl.state import DynamicState

__all__ = [
    "BRANCHES",
    "DBB4_BRANCHES",
    "ORIGINAL",
    "ConvGeometry",
    "ConvSite",
    "CutRule",
    "DiverseBranchBlock",
    "DynamicState",
    "ExpansionCost",
    "ModulationPlan",
    "RoundOutcome",
    "SalienceMeter",
    "TrainEpoch",
    "absorb",
    "affordable_capacity",
    "apply_plan",
    "bottom_up",
    "branch_state",
    "capacity_cost",
    "combine_salience",
    "current_structure",
    "cut_branches",
    "dymm_plan",
    "expand_conv",
    "expand_model",
    "expanded_blocks",
    "expansion_cost",
    "find_sites",
    "fuse_block",
    "fuse_model",
    "grow_branches",
    "paper_round",
    "recalibrate",
    "released_plan",
    "released_round",
    "salience",
    "shrink_structure",
    "structure_cost",
    "top_salient",
]
