"""NeFL (Kang et al.): nested width/depth submodels, learnable step sizes, inconsistent BN/steps, NeFedAvg (METHODS §2)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from nestling.aggregation import Contribution, masked_mean
from nestling.errors import ConfigError
from nestling.messages import Result, Task
from nestling.models.config import ModelConfig
from nestling.models.zoo import block_infos
from nestling.server.strategies.base import DeviceInfo, EvalTarget, Strategy
from nestling.server.strategies.nefl_presets import nefl_family
from nestling.server.strategies.registry import register_strategy
from nestling.slicing import extract, roles_for, slices_for
from nestling.spec import SubmodelSpec


class NeFL(Strategy):
    """Consistent tensors (convs, classifier weight and bias) live once, nested; every submodel k owns a
    full copy of its BN tensors and step sizes, averaged only among the clients that trained k."""

    name = "nefl-wd"
    planning = "family"
    mode: ClassVar[str] = "wd"
    # shortcut_from_skipping (AMBIG-2): also aggregate a skipped stage-entry block's projection from the
    # clients that skip the block (they do use it); off by default, as in the reference.
    # step_init "one": every kept block starts at s = 1; "do" (NeFL-DO): a kept block followed by m skipped
    # blocks of its stage starts at 1 + m (§2.a.1).
    option_defaults: ClassVar[dict[str, Any]] = {
        "flex": 2,
        "learnable_step": True,
        "shortcut_from_skipping": False,
        "step_init": "one",
    }

    def make_model_config(self) -> ModelConfig:
        return self.ctx.model_config(learnable_step=bool(self.options["learnable_step"]))

    def setup(self) -> None:
        if self.options["step_init"] not in ("one", "do"):
            raise ConfigError(f"[method] step_init must be 'one' or 'do', got '{self.options['step_init']}'")
        family = nefl_family(self.model.arch, self.mode, self.model.extra)
        self.specs = [SubmodelSpec(self.model, width=rho, blocks=kept) for rho, kept in family]
        self.index_of = {s.id: k for k, s in enumerate(self.specs)}
        self.stores: list[dict[str, torch.Tensor]] = []
        for spec in self.specs:
            roles = roles_for(spec)
            own = {k for k, r in roles.items() if r in ("norm", "step")}
            self.stores.append(extract(self.global_state, spec, keys=own))
            if self.options["step_init"] == "do":
                for block, value in do_initial_steps(spec).items():
                    self.stores[-1][f"blocks.{block}.step"].fill_(value)
        # LayerNorms are consistent: the paper found that better than the code's per-submodel LN (AMBIG-3).
        self.consistent = {k for k, r in roles_for(self.full_spec).items() if r in ("weight", "layer_norm")}

    @property
    def num_submodels(self) -> int:
        return len(self.specs)

    def tier_of(self, device: DeviceInfo) -> int:
        """Contiguous equal tiers by client index (METHODS §2.a.5), the device's enrolled tier, or the largest
        submodel that fits the memory budget it registered (profiler.planner)."""
        fitted = self.fit_by_budget(device, self.specs)
        if fitted is not None:
            return fitted
        if device.tier is not None:
            return min(device.tier, self.num_submodels - 1)
        per_tier = max(1, self.ctx.num_clients / self.num_submodels)
        return min(int(device.index // per_tier), self.num_submodels - 1)

    def spec_for(self, round_index: int, device: DeviceInfo) -> SubmodelSpec:
        tier, flex = self.tier_of(device), int(self.options["flex"])
        capped = self.sized_by_fit(device)  # never above the fit
        low, high = max(0, tier - flex), tier if capped else min(self.num_submodels - 1, tier + flex)
        rng = self.round_rng(round_index, salt=device.index + 1)
        return self.specs[int(rng.integers(low, high + 1))]

    def deploy_spec(self, device: DeviceInfo, last_round: int) -> SubmodelSpec:
        """The device's own tier (the largest submodel that fits it), not the neighbour `flex` may draw."""
        return self.specs[self.tier_of(device)]

    def task_weights(self, spec: SubmodelSpec) -> dict[str, torch.Tensor]:
        k = self.index_of[spec.id]
        weights = extract(self.global_state, spec, keys=self.consistent)
        weights.update({key: value.clone() for key, value in self.stores[k].items()})
        return weights

    def counted_keys(self, spec: SubmodelSpec) -> set[str]:
        """Consistent tensors a client of `spec` counts for: none in blocks it skips (§2.a.6, AMBIG-2)."""
        if spec.blocks is None or self.options["shortcut_from_skipping"]:
            return self.consistent
        skipped = tuple(f"blocks.{b}." for b in range(len(block_infos(spec))) if b not in spec.blocks)
        return {k for k in self.consistent if not k.startswith(skipped)}

    def aggregate(self, round_index: int, accepted: list[tuple[Task, Result]]) -> None:
        # NeFedAvg on consistent tensors: per-element counts, uniform weights, depth-aware (§2.a.6).
        contributions = []
        for task, result in accepted:
            keys = self.counted_keys(SubmodelSpec.from_dict(task.spec))
            contributions += self.contributions([(task, result)], keys)
        self.global_state.update(masked_mean(self.global_state, contributions))
        # Inconsistent tensors: mean over the uploads of each submodel only; unsampled ones unchanged.
        for k, spec in enumerate(self.specs):
            mine = [(t, r) for t, r in accepted if SubmodelSpec.from_dict(t.spec).id == spec.id]
            if not mine:
                continue
            regions = slices_for(spec)
            contributions = [
                Contribution({key: r.weights[key] for key in self.stores[k]}, regions) for _, r in mine
            ]
            old = self.stores[k]
            self.stores[k] = {**old, **masked_mean(old, contributions)}
            # BN batch counters are summed (§2.a.6 step 5), not averaged: the store counts every batch its
            # uploads trained (old + Σ new batches; summing the uploads themselves would add `old` b_k times).
            for key, value in old.items():
                if not value.is_floating_point():
                    added = torch.stack([r.weights[key] - value for _, r in mine]).sum(dim=0)
                    self.stores[k][key] = value + added

    def eval_targets(self) -> list[EvalTarget]:
        return [EvalTarget(f"k{k + 1}", spec, self.task_weights(spec)) for k, spec in enumerate(self.specs)]

    def global_export_state(self) -> dict[str, torch.Tensor]:
        """Consistent weights + the largest submodel's BN and steps (NeFL's "Global BN embedding")."""
        state = dict(self.global_state)
        state.update(self.stores[-1])
        return state

    def state_tensors(self) -> dict[str, torch.Tensor]:
        tensors = super().state_tensors()
        for k, store in enumerate(self.stores):
            tensors.update({f"store{k}/{key}": value for key, value in store.items()})
        return tensors

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        super().load_state(tensors, meta)
        for k, store in enumerate(self.stores):
            for key in store:
                if f"store{k}/{key}" not in tensors:
                    raise ConfigError(f"checkpoint lacks NeFL store {k} tensor '{key}'")
                store[key] = tensors[f"store{k}/{key}"].clone()


def do_initial_steps(spec: SubmodelSpec) -> dict[int, float]:
    """NeFL-DO: each kept block's initial step = 1 + the number of skipped blocks after it in its stage."""
    if spec.blocks is None:
        return {}
    infos = block_infos(spec)
    kept = set(spec.blocks)
    steps: dict[int, float] = {}
    for info in infos:
        if info.index not in kept:
            continue
        skipped_after = 0
        for later in infos[info.index + 1 :]:
            if later.stage != info.stage or later.index in kept:
                break
            skipped_after += 1
        steps[info.index] = 1.0 + skipped_after
    return steps


@register_strategy
class NeFLW(NeFL):
    name = "nefl-w"
    mode = "w"


@register_strategy
class NeFLD(NeFL):
    name = "nefl-d"
    mode = "d"


@register_strategy
class NeFLWD(NeFL):
    name = "nefl-wd"
    mode = "wd"
