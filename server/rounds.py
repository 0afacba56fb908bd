"""What a run's rounds are told (`RoundPolicy`) and what each round leaves behind (`RoundRecord`: its line in
metrics.jsonl, and what `on_round` callbacks receive)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from nestling.server.screening import RobustPolicy


@dataclass
class RoundPolicy:
    """How rounds are run: participation, over-selection, quorum, deadline, evaluation and checkpoints."""

    rounds: int
    fraction: float = 0.1
    over_selection: float = 1.0  # fleets use 1.3: dispatch to 30% more devices than the round needs
    quorum: float = 1.0  # fraction of the needed results below which a round is abandoned
    deadline_s: float | None = None
    eval_every: int = 1
    checkpoint_every: int = 1
    seed: int = 0
    robust: RobustPolicy = field(default_factory=RobustPolicy)


@dataclass
class RoundRecord:
    """One round as it happened: who took part, what was accepted and applied, what it cost and scored."""

    round: int
    wall_seconds: float
    collect_seconds: float
    virtual_time: float
    selected: int
    accepted: int
    aggregated: bool
    bytes_down: int
    bytes_up: int
    local_train_seconds: float = 0.0  # Σ of the training time devices reported (compute-seconds, all workers)
    counters: dict[str, int] = field(default_factory=dict)
    submodels: list[dict[str, Any]] = field(default_factory=list)
    train_loss: float | None = None
    # Clock readings (virtual seconds in a replay, monotonic wall seconds on a fleet) when the round's tasks
    # started going out and when the round closed: closed_at - dispatched_at is the round's duration on the
    # devices' side, without the server's selection, aggregation, evaluation and checkpoint around it.
    dispatched_at: float = 0.0
    closed_at: float = 0.0
    # Divergence guard: the round whose aggregation was undone (this one or the previous) and the devices
    # whose updates it applied, now skipped for [run] quarantine_rounds rounds.
    rolled_back: int | None = None
    quarantined: list[str] = field(default_factory=list)
    # The cohort update screen's verdicts (device ids it judged and refused; server/strikes.py keeps each board's
    # record of them; "medians": each submodel cohort's median cosine, which later rounds' consensus looks back
    # on) and the boards set aside this round (device -> first round it may be selected again),
    # for rollbacks and strikes alike. Left out of metrics.jsonl when empty.
    cohort_screen: dict[str, Any] = field(default_factory=dict)
    set_aside: dict[str, int] = field(default_factory=dict)
    method: dict[str, Any] = field(
        default_factory=dict
    )  # what the strategy reports of the round (round_report)
    # Profiled boards (profiler/fit.py): each one's spec, why, predicted and observed local training time and
    # speed factor; and the boards whose sizing changed this round. Left out of metrics.jsonl when empty.
    plans: dict[str, dict[str, Any]] = field(default_factory=dict)
    replans: list[dict[str, Any]] = field(default_factory=list)
    # Median rms of the round's screened updates (trained weights): what later rounds' screening looks back
    # on (server/screening.py `outliers`). Left out of metrics.jsonl when the round screened nothing.
    update_rms: float | None = None


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes a set of tensors takes on the wire (the round's bytes_down / bytes_up)."""
    return int(sum(t.numel() * t.element_size() for t in tensors.values()))
