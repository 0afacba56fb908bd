"""What a run leaves on disk, and how it continues from there: the submodels scored on the policy's evaluation
rounds, each round's line in metrics.jsonl, checkpoints on the policy's checkpoint rounds, and the resume from
the newest complete checkpoint."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch

from nestling.errors import NestlingError
from nestling.server.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    load_checkpoint_side,
    save_strategy_checkpoint,
)
from nestling.server.evaluation import EvalResult, Evaluator
from nestling.server.rounds import RoundPolicy, RoundRecord
from nestling.server.strategies.base import Strategy
from nestling.strict_json import strict_dumps


class SideState(Protocol):
    """State outside the strategy that a checkpoint must carry for a resumed run to match an uninterrupted
    one: the simulator's per-device stores (on a real fleet they stay on the boards)."""

    name: str

    def snapshot(self) -> dict[str, torch.Tensor]: ...

    def restore(self, tensors: dict[str, torch.Tensor]) -> None: ...


class RunRecorder:
    """Scores, records and checkpoints a run's rounds under `out_dir` (nothing is written without one), and
    resumes it. Owns the run's counter totals (checkpointed) and the latest evaluation."""

    def __init__(
        self,
        strategy: Strategy,
        evaluator: Evaluator | None,
        policy: RoundPolicy,
        out_dir: Path | None = None,
        side: SideState | None = None,
    ) -> None:
        self.strategy = strategy
        self.evaluator = evaluator
        self.policy = policy
        self.out_dir = out_dir
        self.side = side
        self.totals: Counter[str] = Counter()
        self.last_eval: list[EvalResult] = []

    def is_eval_round(self, round_index: int) -> bool:
        """The last round and every eval_every-th (none but the last when eval_every is 0)."""
        last = round_index == self.policy.rounds - 1
        return last or (self.policy.eval_every > 0 and (round_index + 1) % self.policy.eval_every == 0)

    def evaluate(self, round_index: int, record: RoundRecord) -> None:
        """On an evaluation round, score the strategy's targets and add them to the round's record."""
        if self.is_eval_round(round_index):
            self.last_eval = (
                self.evaluator.evaluate_all(self.strategy.eval_targets()) if self.evaluator else []
            )
            record.submodels = [asdict(e) for e in self.last_eval]

    def record(self, round_index: int, record: RoundRecord, counters: Counter[str]) -> None:
        """Add the round's counters to the totals, append its metrics line and checkpoint when due."""
        self.totals.update(counters)
        if self.out_dir is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        line = asdict(record)
        for key in ("plans", "replans", "cohort_screen", "set_aside"):  # left out when empty
            if not line[key]:
                del line[key]
        if line["update_rms"] is None:
            del line["update_rms"]
        with (self.out_dir / "metrics.jsonl").open("a") as fh:
            fh.write(strict_dumps(line) + "\n")
        last = round_index == self.policy.rounds - 1
        if last or (
            self.policy.checkpoint_every > 0 and (round_index + 1) % self.policy.checkpoint_every == 0
        ):
            save_strategy_checkpoint(
                self.out_dir / "checkpoints",
                round_index,
                self.strategy,
                seed=self.policy.seed,
                totals=self.totals,
                sides={self.side.name: self.side.snapshot()} if self.side else None,
            )

    def resume(self) -> tuple[int, list[dict[str, Any]]]:
        """Load the newest complete checkpoint into the strategy (and side state and totals); drop the metrics
        of later, unfinished rounds. Returns the round to continue with and the metrics lines kept."""
        if self.out_dir is None:
            raise NestlingError("--resume needs an output directory")
        path = latest_checkpoint(self.out_dir / "checkpoints")
        if path is None:
            raise NestlingError(f"no complete checkpoint under {self.out_dir / 'checkpoints'}")
        tensors, manifest = load_checkpoint(path)
        if manifest.get("method") != self.strategy.name:
            raise NestlingError(
                f"checkpoint is for method '{manifest.get('method')}', not '{self.strategy.name}'"
            )
        self.strategy.load_state(tensors, manifest.get("strategy", {}))
        self.strategy.load_planning_state(manifest.get("planning") or {})
        if self.side:
            self.side.restore(load_checkpoint_side(path, self.side.name) or {})
        self.totals.update(manifest.get("totals", {}))
        start_round = int(manifest["round"]) + 1
        metrics = self.out_dir / "metrics.jsonl"
        if not metrics.exists():
            return start_round, []
        kept = [
            line
            for line in metrics.read_text().splitlines()
            if line.strip() and json.loads(line)["round"] < start_round
        ]
        metrics.write_text("".join(line + "\n" for line in kept))
        return start_round, [json.loads(line) for line in kept]
