"""Part records of a submodel as `Walk` gave them, now read off the derived trace (profiler/trace.py).

Kept only for server/strategies/scalefl_split.py, which counts parameters per part through `Walk(...).records`
(a build on the meta device, no forward);
new code asks `nestling.profiler.trace.trace(spec).parts` or `estimator.estimate(spec, batch).parts`.
"""

from __future__ import annotations

from nestling.profiler.trace import PartParams, part_params, trace
from nestling.spec import SubmodelSpec


class Walk:
    """`spec` at `batch`: `records` (per part parameters) after `run()`, saved bytes per part from the trace."""

    def __init__(self, spec: SubmodelSpec, batch: int) -> None:
        self.spec, self.batch = spec, batch
        self.records: list[PartParams] = []

    def run(self) -> None:
        self.records = list(part_params(self.spec))

    def part_bytes(self, name: str) -> int:
        return trace(self.spec).part_bytes(name, self.batch)

    def total_bytes(self) -> int:
        return trace(self.spec).total_bytes(self.batch)
