"""Board catalogue: every class the issue names, sourced figures, and a docs page that matches."""

from __future__ import annotations

from pathlib import Path

import pytest

from nestling.errors import ConfigError
from nestling.profiler.catalogue import BOARDS, catalogue_markdown_table, get_board

DOCS = Path(__file__).resolve().parents[2] / "docs" / "devices.md"
REQUIRED = {
    "rpi4",
    "rpi5",
    "jetson-nano",
    "jetson-xavier-nx",
    "jetson-orin-nano",
    "jetson-agx-orin",
    "phone-low",
    "phone-mid",
    "phone-high",
    "laptop",
}


def test_catalogue_covers_the_issue_classes() -> None:
    assert set(BOARDS) >= REQUIRED


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_figures_are_consistent_and_sourced(name: str) -> None:
    board = get_board(name)
    assert 0 < board.memory_budget_bytes < board.ram_bytes
    assert board.sustained_gflops == pytest.approx(board.peak_gflops_fp32 * board.utilisation)
    assert 0 < board.utilisation <= 1
    assert board.up_bps > 0 and board.down_bps > 0 and board.latency_s > 0 and board.power_w > 0
    assert board.sources and all(source.strip() for source in board.sources)
    assert board.peak_derivation and board.network.source
    assert board.kind in {"board", "phone", "laptop"} and board.compute_unit in {"cpu", "gpu"}


def test_published_anchors() -> None:
    # DEVICES.md: Nano 128 x 2 x 0.9216 = 236 GFLOPS (D); AGX Orin 5.3 TFLOPS (V).
    assert get_board("jetson-nano").peak_gflops_fp32 == pytest.approx(128 * 2 * 0.9216, rel=1e-3)
    assert get_board("jetson-agx-orin").peak_gflops_fp32 == 5300.0
    assert get_board("rpi5").sustained_gflops > get_board("rpi4").sustained_gflops


def test_unknown_board_lists_known_names() -> None:
    with pytest.raises(ConfigError, match=r"unknown board class 'rpi3'.*rpi4.*jetson-nano.*laptop"):
        get_board("rpi3")


def test_docs_table_matches_catalogue() -> None:
    assert catalogue_markdown_table() in DOCS.read_text(encoding="utf-8")
