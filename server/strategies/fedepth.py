"""FeDepth and m-FeDepth (Zhang et al.): every client trains the full model depth-wise within its memory (METHODS §3)."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from nestling.aggregation import Contribution
from nestling.errors import ConfigError
from nestling.messages import Result, Task
from nestling.models.config import ModelConfig
from nestling.models.family import family_of
from nestling.models.zoo import block_infos
from nestling.profiler.decompose import (
    PAPER_WIDTH_MB,
    DepthCosts,
    StagePlan,
    depth_costs,
    depth_costs_from_profile,
    width_budget,
)
from nestling.profiler.estimator import estimate
from nestling.server.strategies.base import DeviceInfo, EvalTarget, Strategy
from nestling.server.strategies.fedepth_paper import paper_plan
from nestling.server.strategies.registry import register_strategy
from nestling.spec import SubmodelSpec

log = logging.getLogger(__name__)

# METHODS §3.a.1 (FeDepth paper §Experiments): width ratios r, a quarter of the clients each (tier = ⌊4i/N⌋).
# A budget is R(r), the training memory of the ×r-width model; r = 2 means room for two full models.
BUDGET_PRESETS: dict[str, tuple[float, ...]] = {
    "fair": (1 / 6, 1 / 3, 1 / 2, 1.0),
    "lack": (1 / 8, 1 / 6, 1 / 2, 1.0),
    "surplus": (1 / 6, 1 / 3, 1 / 2, 2.0),
}


def budget_ratios(option: Any) -> tuple[float, ...]:
    """A preset name or an explicit list of width ratios."""
    if isinstance(option, str):
        try:
            return BUDGET_PRESETS[option]
        except KeyError:
            raise ConfigError(
                f"[method] unknown FeDepth budgets '{option}' (known: {', '.join(BUDGET_PRESETS)}, "
                "or a list of width ratios)"
            ) from None
    try:
        ratios = tuple(float(r) for r in option)
    except (TypeError, ValueError):
        raise ConfigError(
            f"[method] budgets must be a preset name or a list of width ratios, got {option!r}"
        ) from None
    if not ratios or any(r <= 0 for r in ratios):
        raise ConfigError(f"[method] budget width ratios must be > 0, got {list(ratios)}")
    return ratios


@register_strategy
class FeDepth(Strategy):
    """Plans come from the greedy decomposition of each client's budget over the run's per-block training
    memory (estimated, or measured on this machine with `memory = "measure"`), or with `plan = "paper"` from
    the paper's own PreResNet-20 table (the stages METHODS §3.a.2 lists). Aggregation is FedAvg over
    every tensor (n_k weights, §3.a.6); bypassed blocks are averaged with the client's unchanged copy
    unless `aggregate_bypassed = false`."""

    name = "fedepth"
    planning = "depthwise"
    option_types: ClassVar[dict[str, tuple[type, ...] | None]] = {"budgets": (str, list, tuple)}
    sizing_reason = "decomposed by memory"  # a profiled board's stages follow its measured memory
    procedure = "fedepth"
    option_defaults: ClassVar[dict[str, Any]] = {
        "budgets": "fair",
        "tolerance": 0.05,
        "variant": "skip",
        "memory": "estimate",
        "stage_steps": "full",
        "masked_ce": False,
        "norm_stats": "batch",
        "resource_weight": False,
        "aggregate_bypassed": True,
        "max_models": 1,
        "kd_weight": 1.0,
        "mutual_depthwise": False,
        "plan": "memory",
    }

    def make_model_config(self) -> ModelConfig:
        variant, stats = self.options["variant"], self.options["norm_stats"]
        if variant not in ("skip", "aux"):
            raise ConfigError(f"[method] {self.name} variant must be 'skip' or 'aux', got '{variant}'")
        if stats not in ("batch", "running"):
            raise ConfigError(f"[method] {self.name} norm_stats must be 'batch' or 'running', got '{stats}'")
        model = self.ctx.model_config(norm_stats=stats)
        if variant == "aux":  # §3.a.8: a head after every block a stage can end at
            count = len(block_infos(model.arch, model.image_size, model.extra))
            model = model.with_(exit_points=tuple(range(count - 1)), exit_kind="fedepth")
        return model

    def setup(self) -> None:
        for key, allowed in (
            ("memory", ("estimate", "measure")),
            ("stage_steps", ("full", "split")),
            ("plan", ("memory", "paper")),
        ):
            if self.options[key] not in allowed:
                raise ConfigError(
                    f"[method] {self.name} {key} must be one of {allowed}, got '{self.options[key]}'"
                )
        self.ratios = budget_ratios(self.options["budgets"])
        # Without bypassed blocks in the mean, their tensors are left out of the upload.
        self.partial_uploads = not bool(self.options["aggregate_bypassed"])  # type: ignore[misc]
        self.tolerance = float(self.options["tolerance"])
        self.max_models = int(self.options["max_models"])
        if self.max_models < 1:
            raise ConfigError(f"[method] max_models must be >= 1, got {self.max_models}")
        self.batch = int(self.ctx.local.get("batch_size", 32))
        self.momentum = float(self.ctx.local.get("momentum", 0.0)) > 0.0
        self.stem_every_stage = family_of(self.model.arch).stem_trains_every_stage  # §3.a.9 (ViT)
        self.costs = self._cost_table()
        self.ratio_bytes = {r: self._width_bytes(r) for r in self.ratios}
        self._plans: dict[int, tuple[StagePlan, int]] = {}
        self._paper_plans: dict[float, tuple[StagePlan, int]] = {}
        self._paper_bytes: dict[float, int] = {}
        for r, budget in self.ratio_bytes.items():
            try:
                if self.options["plan"] == "paper":
                    self.paper_plan_for(r)
                else:
                    self.plan_for_budget(budget)
            except ConfigError as exc:
                raise ConfigError(
                    f"[method] {self.name}: budget ×{r:g} ({budget / 2**20:.1f} MiB): {exc}"
                ) from None

    def _cost_table(self) -> DepthCosts:
        aux = self.options["variant"] == "aux"
        if self.options["memory"] == "measure":
            from nestling.profiler.measure import profile_model

            profile = profile_model(
                self.full_spec,
                self.batch,
                repeats=1,
                warmup=1,
                momentum=0.9 if self.momentum else 0.0,
                rss_check=False,
            )
            return depth_costs_from_profile(profile, aux_heads=aux)
        return depth_costs(estimate(self.full_spec, self.batch, momentum=self.momentum), aux_heads=aux)

    def _width_bytes(self, ratio: float) -> int:
        if self.options["memory"] == "measure" and ratio <= 1.0:
            from nestling.profiler.measure import profile_model

            plain = SubmodelSpec(self.model.with_(exit_points=()), width=ratio)
            profile = profile_model(
                plain,
                self.batch,
                repeats=1,
                warmup=1,
                momentum=0.9 if self.momentum else 0.0,
                rss_check=False,
            )
            return int(profile["total"]["peak_training_bytes"])
        return width_budget(self.full_spec, ratio, self.batch, momentum=self.momentum)

    # -- planning -----------------------------------------------------------------------------------
    def plan_for_budget(self, budget: int) -> tuple[StagePlan, int]:
        """Stages and number of models for a memory budget (cached; greedy §3.a.2, m-FeDepth §3.a.7).

        M > 1 models only when each gets a plan without bypass: a single stage (the reference's surplus
        clients), or any stages with `mutual_depthwise`."""
        if budget not in self._plans:
            chosen = None
            for models in range(self.max_models, 1, -1):
                try:
                    plan = self.costs.plan(budget, self.tolerance, models, self.stem_every_stage)
                except ConfigError:
                    continue
                if not plan.bypass and (plan.num_stages == 1 or self.options["mutual_depthwise"]):
                    chosen = (plan, models)
                    break
            self._plans[budget] = chosen or (
                self.costs.plan(budget, self.tolerance, 1, self.stem_every_stage),
                1,
            )
        return self._plans[budget]

    def tier_of(self, device: DeviceInfo) -> int:
        per_tier = max(1.0, self.ctx.num_clients / len(self.ratios))
        return min(int(device.index // per_tier), len(self.ratios) - 1)

    def budget_of(self, device: DeviceInfo) -> int:
        """The device's own budget when it registered one, else its tier's preset R(r)."""
        own = self.memory_budget_of(device)  # hand-set, recorded, or measured by the board
        return own if own is not None else self.ratio_bytes[self.ratios[self.tier_of(device)]]

    def paper_plan_for(self, ratio: float) -> tuple[StagePlan, int]:
        """`plan = "paper"`: the paper's stages for budget ×ratio (server/strategies/fedepth_paper.py)."""
        if ratio not in self._paper_plans:
            self._paper_plans[ratio] = paper_plan(
                self.model.arch,
                ratio,
                self.tolerance,
                self.max_models,
                bool(self.options["mutual_depthwise"]),
            )
        return self._paper_plans[ratio]

    def paper_ratio_of(self, device: DeviceInfo) -> float:
        """The device's tier ratio; a device's own budget picks the largest of the paper's width budgets
        (×1/8 … ×1, or whole models ×2 … ×max_models) whose R(r) it holds."""
        tier_ratio = self.ratios[self.tier_of(device)]
        budget = self.budget_of(device)
        if budget == self.ratio_bytes[tier_ratio]:
            return tier_ratio
        if not self._paper_bytes:
            ratios = [*PAPER_WIDTH_MB, *(float(m) for m in range(2, self.max_models + 1))]
            self._paper_bytes = {r: self._width_bytes(r) for r in ratios}
        held = [r for r, need in self._paper_bytes.items() if need <= budget * (1.0 + self.tolerance)]
        if not held:
            raise ConfigError(
                f"budget {budget / 2**20:.1f} MiB holds none of the FeDepth paper's width budgets "
                f"(×1/8 needs {min(self._paper_bytes.values()) / 2**20:.1f} MiB)"
            )
        return max(held)

    def plan_for(self, device: DeviceInfo) -> tuple[StagePlan, int]:
        try:
            if self.options["plan"] == "paper":
                return self.paper_plan_for(self.paper_ratio_of(device))
            return self.plan_for_budget(self.budget_of(device))
        except ConfigError as exc:
            raise ConfigError(f"device {device.device_id}: {exc}") from None

    # -- the Strategy interface ------------------------------------------------------------------------
    def spec_for(self, round_index: int, device: DeviceInfo) -> SubmodelSpec:
        if self.options["variant"] != "aux":
            return self.full_spec
        plan, _ = self.plan_for(device)
        last = len(block_infos(self.model.arch, self.model.image_size, self.model.extra)) - 1
        exits = tuple(stage[-1] for stage in plan.stages if stage and stage[-1] < last)
        return SubmodelSpec(self.model, exits=exits)

    def local_hparams(self, round_index: int, device: DeviceInfo, spec: SubmodelSpec) -> dict[str, Any]:
        hp = super().local_hparams(round_index, device, spec)
        plan, models = self.plan_for(device)
        hp.update(
            plan=plan.to_dict(),
            models=models,
            variant=self.options["variant"],
            stage_steps=self.options["stage_steps"],
            masked_ce=bool(self.options["masked_ce"]),
            kd_weight=float(self.options["kd_weight"]),
            aggregate_bypassed=bool(self.options["aggregate_bypassed"]),
            stem_every_stage=self.stem_every_stage,
            tier=self.tier_of(device),
        )
        if models > 1:  # m-FeDepth: the board rebuilds the initial global model for its auxiliaries (§3.a.7)
            hp["initial_model"] = {"model": self.model.to_dict(), "seed": self.ctx.seed}
        return hp

    def aggregation_weight(self, result: Result) -> float:
        return float(result.num_samples)

    def contributions(
        self, accepted: list[tuple[Task, Result]], keys: set[str] | None = None
    ) -> list[Contribution]:
        out = super().contributions(accepted, keys)
        if self.options["resource_weight"]:  # the reference's `resouce_w` flag: p_k × (tier + 1)
            for contribution, (task, _) in zip(out, accepted):
                contribution.weight *= int(task.hparams.get("tier", 0)) + 1
        return out

    def eval_targets(self) -> list[EvalTarget]:
        spec = SubmodelSpec(self.model)  # the full model through its final head (aux heads only train)
        return [EvalTarget("full", spec, self.task_weights(spec))]


@register_strategy
class MFeDepth(FeDepth):
    """m-FeDepth: clients with room for M > 1 full models train M by mutual distillation, upload model 1."""

    name = "m-fedepth"
    option_defaults: ClassVar[dict[str, Any]] = {
        **FeDepth.option_defaults,
        "budgets": "surplus",
        "max_models": 2,
    }

    def setup(self) -> None:
        super().setup()
        paper = self.options["plan"] == "paper"
        tiers = [
            self.paper_plan_for(r) if paper else self.plan_for_budget(self.ratio_bytes[r])
            for r in self.ratios
        ]
        if all(models == 1 for _, models in tiers):
            log.warning(
                "m-fedepth: no budget tier (%s) holds %s models without bypassed blocks, so no board distils "
                "and this run is FeDepth; set [method] mutual_depthwise = true (M models trained depth-wise) "
                'or a budget of ×2 or more (budgets = "surplus")',
                ", ".join(f"×{r:g}" for r in self.ratios),
                "two" if self.max_models == 2 else f"2..{self.max_models}",
            )
