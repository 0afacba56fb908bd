"""FedTrans's numerical core (METHODS §4): growable cells, function-preserving widen/deepen, lineage and
similarity, degree of convergence, cell activeness, utility-based assignment and soft aggregation.

The strategy that runs these over rounds (model list, checkpoints, task wiring) builds on this package.
"""

from nestling.methods.fedtrans.activeness import cell_activeness, select_cells
from nestling.methods.fedtrans.assignment import (
    TrainingReport,
    assignment_probabilities,
    compatible_models,
    inherit_utilities,
    sample_model,
    standardised_losses,
    update_utilities,
)
from nestling.methods.fedtrans.cells import CellOrigin, Layout, Provenance, layout_of, model_macs, with_layout
from nestling.methods.fedtrans.convergence import degree_of_convergence, should_transform
from nestling.methods.fedtrans.lineage import Lineage, embed, embed_into_ancestor
from nestling.methods.fedtrans.soft_aggregation import fedavg, soft_aggregate
from nestling.methods.fedtrans.transform import Grown, Transformed, deepen, next_operation, transform, widen

__all__ = [
    "CellOrigin",
    "Grown",
    "Layout",
    "Lineage",
    "Provenance",
    "TrainingReport",
    "Transformed",
    "assignment_probabilities",
    "cell_activeness",
    "compatible_models",
    "deepen",
    "degree_of_convergence",
    "embed",
    "embed_into_ancestor",
    "fedavg",
    "inherit_utilities",
    "layout_of",
    "model_macs",
    "next_operation",
    "sample_model",
    "select_cells",
    "should_transform",
    "soft_aggregate",
    "standardised_losses",
    "transform",
    "update_utilities",
    "widen",
    "with_layout",
]
