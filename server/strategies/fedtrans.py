"""FedTrans (METHODS §4): the server grows a family of models during training and clients pick among them.

The family starts with the run's model (sized for the weakest board). Each round every participant draws a
model it can afford (softmax of its utilities over K_c, seeded per round and client), trains it as a plain
task whose spec carries that model's own ModelConfig (its `extra["layout"]`), and reports its mean training
loss. The server then updates utilities (Eq. 4), averages uploads per model (FedAvg), shares knowledge from
older to newer models (soft aggregation, Eq. 5) and, when the newest model's loss has flattened (DoC ≤ β)
and a stronger board exists, widens/deepens its most active cells into a new model. The numbers live in
`nestling.methods.fedtrans` (docs/fedtrans.md); this class owns the state, the checkpoints and the reports.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from nestling.aggregation import Contribution, masked_mean
from nestling.errors import ConfigError, SpecError
from nestling.messages import Result, Task
from nestling.methods.fedtrans import (
    Lineage,
    TrainingReport,
    cell_activeness,
    compatible_models,
    degree_of_convergence,
    inherit_utilities,
    layout_of,
    model_macs,
    sample_model,
    select_cells,
    soft_aggregate,
    transform,
    update_utilities,
)
from nestling.methods.fedtrans.cells import growable_family, is_statistic
from nestling.methods.fedtrans.transform import OPERATIONS
from nestling.models.config import ModelConfig
from nestling.models.zoo import build
from nestling.profiler.estimator import training_memory
from nestling.profiler.speed import TRAIN_OVER_FORWARD, samples_trained
from nestling.server.strategies.base import DeviceInfo, EvalTarget
from nestling.server.strategies.fedtrans_capacity import (
    Capacity,
    capacity_of,
    reference_gflops,
    validated_tiers,
)
from nestling.server.strategies.fedtrans_report import plot_growth
from nestling.server.strategies.options import MethodOptions
from nestling.server.strategies.registry import register_strategy
from nestling.server.strategies.submodel import SubmodelStrategy
from nestling.slicing import check_result_tensors, extract, slices_for
from nestling.spec import SubmodelSpec

State = dict[str, torch.Tensor]
log = logging.getLogger(__name__)
PAPER_GAMMA, PAPER_DELTA = 10, 20  # METHODS §4.a.1 (δ = 20 is CIFAR-10's)


@dataclass
class FamilyMember:
    """One model of the family: its architecture, weights, and what the strategy tracks about it."""

    config: ModelConfig
    state: State
    macs: int
    operations: tuple[int, ...]  # per cell: operations of its alternating schedule applied so far
    losses: list[float] = field(default_factory=list)  # per round it was trained: mean client training loss
    born: int | None = None  # round of birth (None: the seed model)
    parent: int | None = None
    cells: list[int] = field(default_factory=list)  # the parent's cells selected for its transformation
    applied: list[list[Any]] = field(default_factory=list)  # [operation, parent cell] in the order applied
    uploads: int = 0  # accepted uploads aggregated into it

    @property
    def spec(self) -> SubmodelSpec:
        return SubmodelSpec.full(self.config)

    def meta(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "macs": self.macs,
            "operations": list(self.operations),
            "losses": list(self.losses),
            "born": self.born,
            "parent": self.parent,
            "cells": list(self.cells),
            "applied": [list(a) for a in self.applied],
            "uploads": self.uploads,
        }


def model_name(index: int) -> str:
    """The id of model `index` in tasks, eval targets, exports (`--submodel m2`) and reports."""
    return f"m{index}"


@dataclass(frozen=True)
class FedTransOptions(MethodOptions):
    # METHODS §4.a.1 (paper defaults; δ = 20 is CIFAR-10's: 30 FEMNIST, 100 Speech, 50 OpenImage)
    alpha: float = 0.9  # cell selection: act_l >= alpha * max act
    beta: float = 0.003  # transform when DoC <= beta
    # DoC's slopes and slope width (rounds); "auto": the paper's 10/20 in runs of >= 300 rounds, shorter
    # runs keep the 1:2 ratio within a tenth of the run (`growth_window`), printed at start
    gamma: int | str = "auto"
    delta: int | str = "auto"
    t_act: int = 5  # rounds of aggregated updates behind cell activeness
    eta: float = 0.98  # soft-aggregation decay eta^t (t = global round, AMBIG-12)
    widen_factor: float = 2.0
    deepen_count: int = 1
    first_operation: str = "widen"  # AMBIG-13 DECISION: widen first, then alternate per cell
    noise: float = 0.0  # symmetry-breaking noise on widened units (off: exact preservation)
    l2s: bool = (
        False  # larger models also feed smaller ones in soft aggregation (off: Table 1, METHODS §4.a.2)
    )
    # T_c (server/strategies/fedtrans_capacity.py)
    capacities: tuple[float, ...] = (
        1.0,
        2.0,
        4.0,
        8.0,
        16.0,
        32.0,
    )  # tiers by client index, × the seed's MACs
    capacity_reference: str = "rpi4"  # board class the seed model is sized for (capacity by speed)


@register_strategy
class FedTrans(SubmodelStrategy):
    """Several models with lineage; each task names its model (Task.model_id) and carries its ModelConfig."""

    name = "fedtrans"
    global_state: State  # always the seed model's weights (members[0].state): base model of the deployables
    options_type: ClassVar[type[MethodOptions]] = FedTransOptions
    options: FedTransOptions

    # -- construction ---------------------------------------------------------------------------
    def make_model_config(self) -> ModelConfig:
        config = self.ctx.model_config()
        # families without growable blocks, exits and per-width BN are refused by name
        growable_family(config)
        return config

    def setup(self) -> None:
        o = self.options
        self.alpha = _within("alpha", o.alpha, 0.0, 1.0)
        self.beta = o.beta
        self.eta = _within("eta", o.eta, 0.0, 1.0)
        self.noise = _within("noise", o.noise, 0.0, math.inf)
        self.widen_factor = o.widen_factor
        if self.widen_factor <= 1.0:
            raise ConfigError(f"[method] fedtrans widen_factor must be > 1, got {self.widen_factor}")
        self.gamma, self.delta, self.window_source = growth_window(o.gamma, o.delta, self.ctx.total_rounds)
        _announce_window(self.gamma, self.delta, self.window_source, self.ctx.total_rounds)
        self.t_act = _at_least_one("t_act", o.t_act)
        self.deepen_count = _at_least_one("deepen_count", o.deepen_count)
        self.l2s = o.l2s
        self.first = o.first_operation
        if self.first not in OPERATIONS:
            raise ConfigError(
                f"[method] fedtrans first_operation must be one of {OPERATIONS}, got {self.first!r}"
            )
        self.tiers = validated_tiers(o.capacities)
        self.reference = reference_gflops(o.capacity_reference)
        cells = len(layout_of(self.model).block_hidden)
        self.members = [FamilyMember(self.model, self.global_state, model_macs(self.model), (0,) * cells)]
        self.lineage = Lineage.seeded(cells)
        self.updates: list[State] = []  # the newest model's aggregated updates, last T_act rounds
        self.utilities: dict[str, list[float]] = {}
        self.capacities: dict[str, Capacity] = {}
        self.client_macs = 0.0  # total training MACs of aggregated client work (METHODS §4.a.6 cost)
        self._fits: dict[str, list[int]] = {}  # this round's K_c per participant
        self._memory: dict[str, int] = {}  # spec id -> estimated training bytes
        self._events: dict[str, Any] = {}  # what the last aggregation did, for round_report

    # -- assignment -----------------------------------------------------------------------------
    def capacity(self, device: DeviceInfo) -> Capacity:
        """T_c of `device`, remembered (the strongest one seen bounds growth)."""
        found = capacity_of(device, self.members[0].macs, self.tiers, self.ctx.num_clients, self.reference)
        self.capacities[device.device_id] = found
        return found

    def _training_bytes(self, member: FamilyMember) -> int:
        spec = member.spec
        if spec.id not in self._memory:
            self._memory[spec.id] = training_memory(spec, self.ctx.batch_size, momentum=self.ctx.momentum)
        return self._memory[spec.id]

    def compatible(self, capacity: Capacity) -> list[int]:
        """K_c: models whose MACs fit T_c and whose training memory fits the budget. The seed model is always
        in it: it is by definition the weakest board's model, and a board must be able to train something."""
        fits = compatible_models([m.macs for m in self.members], capacity.macs)
        if capacity.memory_bytes is not None:
            fits = [k for k in fits if self._training_bytes(self.members[k]) <= capacity.memory_bytes]
        return fits if 0 in fits else [0, *fits]

    def _utilities_of(self, device_id: str) -> list[float]:
        """A board seen for the first time starts at utility 0 for every model (AMBIG-11's second half)."""
        return self.utilities.setdefault(device_id, [0.0] * len(self.members))

    def pick(self, round_index: int, device: DeviceInfo) -> tuple[int, list[int]]:
        """The model `device` trains this round and its K_c (same draw on every call: resume-safe)."""
        fits = self.compatible(self.capacity(device))
        utilities = self._utilities_of(device.device_id)
        chosen = sample_model(
            utilities, fits, seed=self.ctx.seed, round_index=round_index, client=device.device_id
        )
        return chosen, fits

    def spec_for(self, round_index: int, device: DeviceInfo) -> SubmodelSpec:
        return self.members[self.pick(round_index, device)[0]].spec

    def assign(self, round_index: int, devices: list[DeviceInfo]) -> dict[str, Task]:
        tasks: dict[str, Task] = {}
        self._fits = {}
        for device in devices:
            chosen, fits = self.pick(round_index, device)
            self._fits[device.device_id] = fits
            member = self.members[chosen]
            spec = member.spec
            tasks[device.device_id] = Task(
                round=round_index,
                device_id=device.device_id,
                spec=spec.to_dict(),
                weights=extract(member.state, spec),
                procedure=self.procedure,
                hparams=self.local_hparams(round_index, device, spec),
                task_id=f"r{round_index}-{device.device_id}",
                model_id=model_name(chosen),
            )
        return tasks

    def deploy_spec(self, device: DeviceInfo, last_round: int) -> SubmodelSpec:
        """The compatible model of highest utility (METHODS §4.a.6), ties broken by `best_model`."""
        return self.members[self.deployed_model(device)].spec

    def deployed_model(self, device: DeviceInfo) -> int:
        fits = self.compatible(self.capacity(device))
        return self.best_model(self._utilities_of(device.device_id), fits)

    def best_model(self, utilities: list[float], fits: list[int]) -> int:
        """Highest utility among `fits`; a tie goes to the model trained in more rounds, then to the older.

        A new model inherits its parent's utilities (Alg. 1, 8a), so every board that has not trained since a
        birth ties parent and child: ties to the newer model would deploy a model trained for a round or two
        to those boards; ties to the more-trained one keep the parent until the child earns its utility."""
        return max(fits, key=lambda k: (utilities[k], len(self.members[k].losses), -k))

    # -- results --------------------------------------------------------------------------------
    def model_of(self, task: Task) -> int:
        """The family index a task's model id names (the server's own record, never the device's)."""
        name = task.model_id
        if not (name.startswith("m") and name[1:].isdigit() and int(name[1:]) < len(self.members)):
            raise SpecError(
                f"task {task.task_id} names model '{name}', not one of m0..m{len(self.members) - 1}"
            )
        return int(name[1:])

    def validate(self, task: Task, result: Result) -> None:
        member = self.members[self.model_of(task)]
        spec = SubmodelSpec.from_dict(task.spec)
        if spec != member.spec:
            raise SpecError(f"task {task.task_id} does not carry the architecture of {task.model_id}")
        check_result_tensors(result.weights, spec, member.state)
        missing = sorted(set(task.weights) - set(result.weights))
        if missing:
            raise SpecError(
                f"result of {result.device_id} lacks {len(missing)} tensors of its model, e.g. {missing[:3]}"
            )
        if result.num_samples < 1:
            raise SpecError(f"result of {result.device_id} reports {result.num_samples} training samples")

    def aggregation_weight(self, result: Result) -> float:
        return float(result.num_samples)

    def aggregate(self, round_index: int, accepted: list[tuple[Task, Result]]) -> None:
        """Utilities (Eq. 4), FedAvg per model, soft aggregation (Eq. 5), then growth if the newest model has
        converged (METHODS §4.a.2 steps 4-8). Every state tensor is replaced, never written in place."""
        by_model: dict[int, list[tuple[Task, Result]]] = {}
        for task, result in accepted:
            by_model.setdefault(self.model_of(task), []).append((task, result))
        averaged: dict[int, State] = {}
        for k, pairs in sorted(by_model.items()):
            member = self.members[k]
            contributions = [
                Contribution(r.weights, slices_for(member.spec), self.aggregation_weight(r)) for _, r in pairs
            ]
            averaged[k] = {**member.state, **masked_mean(member.state, contributions)}
        self._update_utilities(by_model)
        newest = len(self.members) - 1
        if newest in averaged:
            current = self.members[newest].state
            update = {
                key: current[key] - value
                for key, value in averaged[newest].items()
                if value.is_floating_point() and not is_statistic(key)
            }
            self.updates = [*self.updates, update][-self.t_act :]
        mixed = soft_aggregate(
            [m.state for m in self.members], averaged, self.lineage, round_index, self.eta, l2s=self.l2s
        )
        for member, state in zip(self.members, mixed, strict=True):
            member.state = state
        self.global_state = self.members[0].state
        round_macs = 0.0
        for k, pairs in by_model.items():
            self.members[k].uploads += len(pairs)
            for task, result in pairs:
                samples = samples_trained(task.hparams, result.num_samples)
                round_macs += self.members[k].macs * TRAIN_OVER_FORWARD * samples
        self.client_macs += round_macs
        self._events = {
            "trained": {model_name(k): len(p) for k, p in sorted(by_model.items())},
            "client_macs": round_macs,
        }
        self._maybe_grow(round_index)

    def _update_utilities(self, by_model: dict[int, list[tuple[Task, Result]]]) -> None:
        reports: list[TrainingReport] = []
        per_model: dict[int, list[float]] = {}
        for k, pairs in by_model.items():
            for _, result in pairs:
                loss = result.metrics.get("loss_mean")
                if isinstance(loss, (int, float)) and not isinstance(loss, bool) and math.isfinite(loss):
                    reports.append(TrainingReport(result.device_id, k, float(loss)))
                    per_model.setdefault(k, []).append(float(loss))
        for k, losses in per_model.items():
            self.members[k].losses = [*self.members[k].losses, sum(losses) / len(losses)]
        if not reports:
            return
        clients = {r.client for r in reports}
        fits = {c: self._fits.get(c) or [0] for c in clients}
        rows = {c: self._utilities_of(c) for c in clients}
        self.utilities.update(update_utilities(rows, reports, fits, self.lineage.similarity))

    # -- growth ---------------------------------------------------------------------------------
    def _maybe_grow(self, round_index: int) -> None:
        """METHODS §4.a.2 steps 7-8: DoC of the newest model, then M* from its most active cells."""
        parent = len(self.members) - 1
        newest = self.members[parent]
        doc = degree_of_convergence(newest.losses, self.gamma, self.delta)
        self._events["doc"] = doc
        strongest = max((c.macs for c in self.capacities.values()), default=0.0)
        if doc is None or doc > self.beta or newest.macs >= strongest or not self.updates:
            return
        activeness = cell_activeness(self.updates, newest.state, window=self.t_act)
        cells = select_cells(activeness, self.alpha)
        seed = int(self.round_rng(round_index, salt=0xFED7).integers(2**62))
        grown = transform(
            newest.state,
            newest.config,
            cells,
            newest.operations,
            torch.Generator().manual_seed(seed),
            widen_factor=self.widen_factor,
            deepen_count=self.deepen_count,
            first=self.first,
            noise=self.noise,
        )
        self.lineage.add(parent, grown.provenance)
        child = FamilyMember(
            grown.config,
            grown.state,
            model_macs(grown.config),
            tuple(grown.operations_done),
            born=round_index,
            parent=parent,
            cells=list(cells),
            applied=[list(a) for a in grown.applied],
        )
        self.members.append(child)
        self.utilities = inherit_utilities(self.utilities, parent)
        self.updates = []
        self._events["born"] = self._describe(len(self.members) - 1)

    # -- evaluation and export ------------------------------------------------------------------
    def eval_targets(self) -> list[EvalTarget]:
        """One target per model, in creation order (each newer model costs more MACs than its parent)."""
        return [EvalTarget(model_name(k), m.spec, m.state) for k, m in enumerate(self.members)]

    # -- checkpoints ----------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {
            f"{model_name(k)}/{key}": v for k, m in enumerate(self.members) for key, v in m.state.items()
        }
        for i, update in enumerate(self.updates):
            tensors.update({f"update{i}/{key}": v for key, v in update.items()})
        return tensors

    def state_meta(self) -> dict[str, Any]:
        return {
            "models": [m.meta() for m in self.members],
            "lineage": self.lineage.to_dict(),
            "updates": len(self.updates),
            "utilities": {c: list(row) for c, row in self.utilities.items()},
            "capacities": {d: c.to_list() for d, c in self.capacities.items()},
            "client_macs": self.client_macs,
        }

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Every model, the lineage, the activeness window, utilities and capacities, exactly as saved."""
        if "models" not in meta:
            raise ConfigError("checkpoint does not hold a fedtrans model family (no 'models' in its state)")
        members = []
        for k, record in enumerate(meta["models"]):
            config = ModelConfig.from_dict(record["config"])
            members.append(
                FamilyMember(
                    config,
                    _stored_state(tensors, model_name(k), config),
                    int(record["macs"]),
                    tuple(int(c) for c in record["operations"]),
                    [float(x) for x in record["losses"]],
                    record["born"],
                    record["parent"],
                    [int(c) for c in record["cells"]],
                    [list(a) for a in record["applied"]],
                    int(record["uploads"]),
                )
            )
        if members[0].config != self.model:
            raise ConfigError("checkpoint's seed model differs from this run's model")
        lineage = Lineage.from_dict(meta["lineage"])
        if len(lineage.parents) != len(members):
            raise ConfigError(
                f"checkpoint's lineage holds {len(lineage.parents)} models, its state {len(members)}"
            )
        newest = members[-1].state
        self.updates = []
        for i in range(int(meta["updates"])):
            update = {
                key[len(f"update{i}/") :]: v.clone()
                for key, v in tensors.items()
                if key.startswith(f"update{i}/")
            }
            if any(key not in newest or newest[key].shape != v.shape for key, v in update.items()):
                raise ConfigError(f"checkpoint's aggregated update {i} does not match the newest model")
            self.updates.append(update)
        self.members, self.lineage = members, lineage
        self.global_state = members[0].state
        self.utilities = {str(c): [float(u) for u in row] for c, row in meta["utilities"].items()}
        self.capacities = {str(d): Capacity.from_list(row) for d, row in meta["capacities"].items()}
        self.client_macs = float(meta["client_macs"])
        self._events = {}

    # -- reports --------------------------------------------------------------------------------
    def _describe(self, k: int) -> dict[str, Any]:
        member = self.members[k]
        layout = layout_of(member.config)
        return {
            "id": model_name(k),
            "parent": None if member.parent is None else model_name(member.parent),
            "born_round": member.born,
            "cells_selected": member.cells,
            "applied": member.applied,
            "macs": member.macs,
            "parameters": sum(t.numel() for key, t in member.state.items() if not is_statistic(key)),
            "stage_blocks": list(layout.stage_blocks),
            "block_hidden": list(layout.block_hidden),
            "similarity_to_parent": None
            if member.parent is None
            else self.lineage.similarity(member.parent, k),
        }

    def round_report(self, round_index: int, accepted: list[tuple[Task, Result]]) -> dict[str, Any]:
        """Models in the family, uploads per model, this round's client MACs and DoC, and a birth if any."""
        if not accepted:
            return {"fedtrans": {"models": len(self.members)}}
        report = {"models": len(self.members), **self._events}
        self._events = {}
        return {"fedtrans": report}

    def write_plots(self, out_dir: Path, summary: dict[str, Any]) -> list[Path]:
        """growth.png: the family by birth round and MACs, and each model's final accuracy."""
        models = [self._describe(k) for k in range(len(self.members))]
        return [plot_growth(out_dir, models, summary.get("submodels", []), int(summary.get("rounds", 0)))]

    def run_summary(self) -> dict[str, Any]:
        """Every model (lineage, MACs, parameters, uploads) and which model each board would deploy."""
        deployed: Counter[str] = Counter()
        boards: dict[str, str] = {}
        for device_id, capacity in sorted(self.capacities.items()):
            fits = self.compatible(capacity)
            boards[device_id] = model_name(self.best_model(self._utilities_of(device_id), fits))
            deployed[boards[device_id]] += 1
        models = []
        for k, member in enumerate(self.members):
            described = self._describe(k)
            described.update(
                uploads=member.uploads,
                rounds_trained=len(member.losses),
                boards_deploying=deployed[model_name(k)],
            )
            models.append(described)
        return {
            "fedtrans": {
                "models": models,
                "client_macs_total": self.client_macs,
                "growth_window": {"gamma": self.gamma, "delta": self.delta, "source": self.window_source},
                "deployed": boards,
                "capacity_sources": dict(Counter(c.source for c in self.capacities.values())),
            }
        }


def _stored_state(tensors: dict[str, torch.Tensor], prefix: str, config: ModelConfig) -> State:
    """Model `prefix`'s tensors from a checkpoint, checked against the architecture its config describes."""
    with torch.random.fork_rng(devices=[]):
        expected = build(SubmodelSpec.full(config), init=False).state_dict()
    state: State = {}
    for key, reference in expected.items():
        stored = tensors.get(f"{prefix}/{key}")
        if stored is None or stored.shape != reference.shape:
            raise ConfigError(f"checkpoint does not match fedtrans model {prefix} at tensor '{key}'")
        state[key] = stored.clone()
    return state


def _within(key: str, value: float, low: float, high: float) -> float:
    if not low <= value <= high:
        raise ConfigError(f"[method] fedtrans {key} must be a number in [{low}, {high}], got {value!r}")
    return value


def growth_window(gamma: Any, delta: Any, total_rounds: int) -> tuple[int, int, str]:
    """(γ, δ, where they came from): DoC needs γ + δ rounds of the newest model's loss before any growth.

    "auto" keeps the paper's 10 and 20 when the run has at least ten times their 30 rounds; a shorter run
    scales the window to a tenth of its rounds (at least 2) in the paper's 1:2 ratio, so growth can happen in
    the run at all: 10 rounds → γ 1, δ 1; 40 → 1, 3; 100 → 3, 7. Integers are taken as given."""
    given = {"gamma": gamma, "delta": delta}
    for key, value in given.items():
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f'[method] fedtrans {key} must be an integer >= 1 or "auto", got {value!r}')
    if gamma != "auto" and delta != "auto":
        return int(gamma), int(delta), "given"
    window = min(PAPER_GAMMA + PAPER_DELTA, max(2, total_rounds // 10))
    auto_gamma = max(1, round(window * PAPER_GAMMA / (PAPER_GAMMA + PAPER_DELTA)))
    chosen_gamma = auto_gamma if gamma == "auto" else int(gamma)
    chosen_delta = max(1, window - chosen_gamma) if delta == "auto" else int(delta)
    source = "paper" if (chosen_gamma, chosen_delta) == (PAPER_GAMMA, PAPER_DELTA) else "scaled to the run"
    return chosen_gamma, chosen_delta, source


def _announce_window(gamma: int, delta: int, source: str, total_rounds: int) -> None:
    """Say at start what the DoC window means for this run (a window as long as the run is plain FedAvg)."""
    if gamma + delta >= total_rounds:
        log.warning(
            "fedtrans: gamma %d + delta %d = %d rounds of loss history before any growth, and the run has %d "
            "rounds: the family never grows, so this run is FedAvg of the seed model (lower gamma/delta or "
            'leave them "auto")',
            gamma,
            delta,
            gamma + delta,
            total_rounds,
        )
    elif source == "scaled to the run":
        log.warning(
            "fedtrans: DoC window scaled to the %d-round run: gamma %d, delta %d (the paper's %d/%d would "
            "need %d rounds of loss history before the first growth); set them in [method] to choose",
            total_rounds,
            gamma,
            delta,
            PAPER_GAMMA,
            PAPER_DELTA,
            PAPER_GAMMA + PAPER_DELTA,
        )


def _at_least_one(key: str, value: int) -> int:
    if value < 1:
        raise ConfigError(f"[method] fedtrans {key} must be an integer >= 1, got {value!r}")
    return value
