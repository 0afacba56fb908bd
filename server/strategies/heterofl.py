"""HeteroFL (Diao et al., ICLR 2021): width prefixes, Scaler, static BN, optional label-masked CE (METHODS §7.1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from nestling.errors import ConfigError
from nestling.messages import Result, Task
from nestling.models.config import ModelConfig
from nestling.models.zoo import class_logit_keys
from nestling.server.strategies.base import DeviceInfo, EvalTarget
from nestling.server.strategies.options import MethodOptions
from nestling.server.strategies.planning import FamilyPlanning
from nestling.server.strategies.registry import register_strategy
from nestling.server.strategies.submodel import SubmodelStrategy
from nestling.spec import SubmodelSpec

RATE_LETTERS = {"a": 1.0, "b": 0.5, "c": 0.25, "d": 0.125, "e": 0.0625}


def parse_rate_mix(mix: str) -> list[tuple[float, float]]:
    """'a1-b1-c1-d1-e1' → [(1.0, 0.2), (0.5, 0.2), ...]: each rate with its share of clients."""
    pairs: list[tuple[float, float]] = []
    for part in mix.split("-"):
        letter, share = part[:1], part[1:]
        if letter not in RATE_LETTERS or not share.replace(".", "", 1).isdigit():
            raise ConfigError(
                f"[method] bad HeteroFL rate mix '{mix}': expected parts like a1-b1 (a=1 … e=1/16)"
            )
        pairs.append((RATE_LETTERS[letter], float(share)))
    total = sum(s for _, s in pairs)
    return [(rate, share / total) for rate, share in pairs]


@dataclass(frozen=True)
class HeteroFLOptions(MethodOptions):
    # Default rates: HeteroFL's own 1, 1/2, 1/4, 1/8, 1/16 (METHODS §7.1), one fifth of the clients each.
    # Comparisons at other sizes pass theirs (examples/reproduce/nefl.toml: NeFL's channel ratios √γ).
    rates: tuple[float, ...] = tuple(RATE_LETTERS.values())
    mix: str | None = None  # rates with client shares, e.g. "a1-b1-c1-d1-e1" (overrides `rates`)
    # Which contiguous client block takes which of `rates`: "widest-first" (HeteroFL's own: the first clients
    # train the full width) or "listed" (block k takes rates[k]; a comparison lists them in the order its other
    # methods give their tiers, so tier k lands on the same clients). A `mix` is always taken as listed.
    order: str = "widest-first"
    mode: str = "fix"
    masked_ce: bool = False
    static_bn: bool = True


@register_strategy
class HeteroFL(FamilyPlanning, SubmodelStrategy):
    """`fix` mode: contiguous client blocks keep their rate; `dynamic`: rates re-drawn every round."""

    name = "heterofl"
    options_type: ClassVar[type[MethodOptions]] = HeteroFLOptions
    options: HeteroFLOptions

    def make_model_config(self) -> ModelConfig:
        return self.ctx.model_config(norm_stats="batch", scaler="train")

    def setup(self) -> None:
        if self.options.mix is not None:
            self.mix = parse_rate_mix(self.options.mix)
        else:
            rates = list(self.options.rates)
            if not rates or any(not 0 < r <= 1 for r in rates):
                raise ConfigError(f"[method] HeteroFL rates must lie in (0, 1], got {rates}")
            if self.options.order not in ("widest-first", "listed"):
                raise ConfigError(
                    f"[method] HeteroFL order must be 'widest-first' or 'listed', got '{self.options.order}'"
                )
            if self.options.order == "widest-first":
                rates = sorted(rates, reverse=True)
            self.mix = [(r, 1 / len(rates)) for r in rates]
        if self.options.mode not in ("fix", "dynamic"):
            raise ConfigError(f"[method] HeteroFL mode must be 'fix' or 'dynamic', got '{self.options.mode}'")
        rates = sorted({rate for rate, _ in self.mix})
        self.specs = {rate: SubmodelSpec(self.model, width=rate) for rate in rates}
        self.class_rows = class_logit_keys(self.full_spec)  # the tensors masked CE masks by class

    def rate_of(self, round_index: int, device: DeviceInfo) -> float:
        rates = sorted(self.specs)
        fitted = self.fit_by_budget(device, [self.specs[r] for r in rates])
        if fitted is not None:  # a registered budget: the widest rate that fits it
            return rates[fitted]
        if self.options.mode == "dynamic":
            rng = self.round_rng(round_index, salt=device.index + 1)
            return self.mix[int(rng.choice(len(self.mix), p=[s for _, s in self.mix]))][0]
        position = device.index / max(1, self.ctx.num_clients)
        cumulative = 0.0
        for rate, share in self.mix:
            cumulative += share
            if position < cumulative - 1e-12:
                return rate
        return self.mix[-1][0]

    def spec_for(self, round_index: int, device: DeviceInfo) -> SubmodelSpec:
        return self.specs[self.rate_of(round_index, device)]

    def local_hparams(self, round_index: int, device: DeviceInfo, spec: SubmodelSpec) -> dict[str, Any]:
        hp = super().local_hparams(round_index, device, spec)
        if self.options.masked_ce and device.labels is not None:
            hp["masked_ce"] = True
            hp["label_set"] = list(device.labels)
        return hp

    def contributions(self, accepted: list[tuple[Task, Result]], keys: set[str] | None = None):
        out = super().contributions(accepted, keys)
        if not self.options.masked_ce:
            return out
        # Classifier rows of class c are averaged only over clients holding c (METHODS §7.1).
        for contribution, (task, _) in zip(out, accepted):
            labels = task.hparams.get("label_set")
            if labels is None:
                continue
            rows = torch.zeros(self.model.num_classes, dtype=torch.bool)
            rows[list(labels)] = True
            for key in contribution.tensors:
                if key in self.class_rows:
                    contribution.row_masks[key] = rows
        return out

    def family(self) -> tuple[list[str], list[SubmodelSpec]]:
        """The widths, narrowest first (`nestling plan`)."""
        rates = sorted(self.specs)
        return [f"w{rate:.3g}" for rate in rates], [self.specs[rate] for rate in rates]

    def eval_targets(self) -> list[EvalTarget]:
        return [
            EvalTarget(f"r{rate:g}", spec, self.task_weights(spec), static_bn=self.options.static_bn)
            for rate, spec in sorted(self.specs.items())
        ]
