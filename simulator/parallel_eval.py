"""Score a round's submodels on the simulator's worker processes, one submodel per job.

The coordinator scored every submodel on its own core while the pool's workers waited: 35-80 % of a 2-core
reproduction's wall time (four ScaleFL levels on 10,000 test images, HeteroFL's sBN calibration passes).
Each worker builds the same evaluator once, from the same fleet arguments, so scores do not depend on where
they were computed."""

from __future__ import annotations

from typing import Any

from nestling.calibration import calibration_subset
from nestling.data import DatasetBundle
from nestling.server.evaluation import Evaluator, TargetRunner
from nestling.simulator.fleetdata import shared_fleet_data


def evaluator_for(
    bundle: DatasetBundle,
    *,
    batch_size: int,
    calibration_samples: int,
    seed: int,
    device: str = "cpu",
    runner: TargetRunner | None = None,
) -> Evaluator:
    """The run's evaluator: the bundle's test split, sBN calibration drawn from its training split by `seed`."""
    return Evaluator(
        bundle.test.x,
        bundle.test.y,
        batch_size=batch_size,
        device=device,
        calibration=calibration_subset(bundle.train.x, calibration_samples, seed),
        runner=runner,
    )


def worker_evaluator(
    fleet: dict[str, Any], batch_size: int, calibration_samples: int, seed: int
) -> Evaluator:
    """A worker's copy of the coordinator's evaluator, over the data the worker already loaded to train."""
    return evaluator_for(
        shared_fleet_data(**fleet).bundle,
        batch_size=batch_size,
        calibration_samples=calibration_samples,
        seed=seed,
    )
