"""The accuracy-parity benchmark trains exactly what vs_flower times as Nestling's bf16 engine."""

from __future__ import annotations

import argparse

from benchmarks.precision_parity import overrides
from benchmarks.vs_flower import ENGINES
from nestling.config import load_config


def test_the_bf16_run_uses_the_settings_of_vs_flowers_bf16_engine_and_fp32_the_textbook_ones() -> None:
    args = argparse.Namespace(data_root="data", rounds=3)
    fast = load_config(None, overrides(args, "bf16", seed=1))
    engine = ENGINES["nestling-bf16"]
    assert (fast.train.precision, fast.train.channels_last, fast.run.batching) == (
        engine.precision,
        engine.channels_last,
        engine.batching,
    )
    plain = load_config(None, overrides(args, "fp32", seed=1))
    assert (plain.train.precision, plain.train.channels_last, plain.run.batching) == ("fp32", False, "off")
    for cfg in (fast, plain):  # the same workload otherwise: FedAvg ResNet-20, 10 of 100 clients, batch 32
        assert (
            cfg.method.name,
            cfg.model.arch,
            cfg.data.clients,
            cfg.train.fraction,
            cfg.train.batch_size,
        ) == ("fedavg", "resnet20", 100, 0.1, 32)
        assert cfg.run.seed == 1 and cfg.run.rounds == 3
