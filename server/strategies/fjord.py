"""FjORD (Horváth et al., NeurIPS 2021): ordered dropout with per-width BN statistics (METHODS §7.2)."""

from __future__ import annotations

from typing import Any, ClassVar

from nestling.messages import Result
from nestling.models.config import ModelConfig
from nestling.server.strategies.base import DeviceInfo, EvalTarget, Strategy
from nestling.server.strategies.registry import register_strategy
from nestling.spec import SubmodelSpec


@register_strategy
class FjORD(Strategy):
    """Each client has a tier p_max; it trains the p_max-wide slice, sampling p ≤ p_max per batch.

    Per-width running statistics are separate buffers (`running_mean_w{j}`), so the masked mean with
    a_k = n_k averages statistics of width p over exactly the clients with p_max ≥ p."""

    name = "fjord"
    planning = "family"
    procedure = "fjord"
    # Default widths: FjORD's own P = (0.2, 0.4, 0.6, 0.8, 1.0) channel ratios (METHODS §7.2). Comparisons at
    # other sizes pass theirs (examples/reproduce/nefl.toml: NeFL's √γ).
    option_defaults: ClassVar[dict[str, Any]] = {
        "widths": (0.2, 0.4, 0.6, 0.8, 1.0),
        "kd": False,
    }

    def make_model_config(self) -> ModelConfig:
        widths = tuple(sorted(float(w) for w in self.options["widths"]))
        return self.ctx.model_config(norm_stats="per_width", width_levels=widths)

    def setup(self) -> None:
        self.widths = list(self.model.width_levels)
        self.specs = {p: SubmodelSpec(self.model, width=p) for p in self.widths}

    def tier_of(self, device: DeviceInfo) -> float:
        fitted = self.fit_by_budget(device, [self.specs[p] for p in self.widths])
        if fitted is not None:  # a registered budget: p_max = the widest width that fits it
            return self.widths[fitted]
        per_tier = max(1, self.ctx.num_clients / len(self.widths))
        return self.widths[min(int(device.index // per_tier), len(self.widths) - 1)]

    def spec_for(self, round_index: int, device: DeviceInfo) -> SubmodelSpec:
        return self.specs[self.tier_of(device)]

    def local_hparams(self, round_index: int, device: DeviceInfo, spec: SubmodelSpec) -> dict[str, Any]:
        hp = super().local_hparams(round_index, device, spec)
        hp.update(p_max=spec.width, widths=self.widths, fjord_kd=bool(self.options["kd"]))
        return hp

    def aggregation_weight(self, result: Result) -> float:
        return float(result.num_samples)

    def eval_targets(self) -> list[EvalTarget]:
        return [
            EvalTarget(f"p{p:g}", spec, self.task_weights(spec), active_width=p)
            for p, spec in self.specs.items()
        ]
