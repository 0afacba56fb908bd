"""Lineage and similarity (METHODS §4.a.5 DECISION): inherited cells count 1, widened ones their inherited
parameter fraction, inserted ones 0; composed along the lineage; symmetric; 1 for a model with itself."""

from __future__ import annotations

import json

import pytest
import torch

from nestling.errors import ConfigError
from nestling.methods.fedtrans import Lineage, deepen, embed, widen
from nestling.methods.fedtrans.cells import CellOrigin, cell_parameter_count
from nestling.models import ModelConfig
from tests.methods.fedtrans.growth_helpers import IMAGE, trained_looking


def _family() -> tuple[Lineage, list[dict[str, torch.Tensor]], list[ModelConfig]]:
    """Seed resnet20 → widen cell 2 → deepen stage 2 after its first block."""
    config = ModelConfig("resnet20", image_size=IMAGE)
    seed = trained_looking(config)
    lineage = Lineage.seeded(9)
    wide = widen(seed, config, 2, 2.0, torch.Generator().manual_seed(0))
    lineage.add(0, wide.provenance)
    deep = deepen(wide.state, wide.config, 2, 1, torch.Generator().manual_seed(1))
    lineage.add(1, deep.provenance)
    return lineage, [seed, wide.state, deep.state], [config, wide.config, deep.config]


def test_similarity_follows_the_inherited_parameters() -> None:
    lineage, states, _ = _family()
    fraction = cell_parameter_count(states[0], 2) / cell_parameter_count(states[1], 2)
    assert 0.4 < fraction < 0.6
    assert lineage.similarity(0, 1) == pytest.approx((8 + fraction) / 9)
    assert lineage.similarity(1, 2) == pytest.approx(9 / 10)
    assert lineage.similarity(0, 2) == pytest.approx((8 + fraction) / 10)  # composed along the lineage
    assert lineage.similarity(2, 0) == lineage.similarity(0, 2)
    assert lineage.similarity(1, 1) == 1.0
    assert lineage.similarity(0, 2) < lineage.similarity(0, 1) < 1.0


def test_models_on_other_branches_share_nothing() -> None:
    lineage, _, _ = _family()
    branch = lineage.add(0, tuple(CellOrigin("inherited", c, 1.0) for c in range(9)))
    assert lineage.similarity(branch, 0) == 1.0
    assert lineage.similarity(branch, 2) == 0.0
    assert lineage.correspondence(1, branch) is None


def test_the_lineage_survives_json() -> None:
    lineage, _, _ = _family()
    again = Lineage.from_dict(json.loads(json.dumps(lineage.to_dict())))
    assert again == lineage
    assert again.similarity(0, 2) == lineage.similarity(0, 2)


def test_a_provenance_naming_missing_cells_is_refused() -> None:
    lineage = Lineage.seeded(3)
    with pytest.raises(ConfigError, match="cells model 0 does not have"):
        lineage.add(0, (CellOrigin("inherited", 5, 1.0),))
    with pytest.raises(ConfigError, match="parent model 4 does not exist"):
        lineage.add(4, ())


def test_embedding_places_older_tensors_on_their_prefix_and_skips_inserted_cells() -> None:
    lineage, states, _ = _family()
    cells = lineage.correspondence(0, 2)
    assert cells is not None
    placed = embed(states[0], states[2], cells)
    # Widened cell 2: the old 16 units cover the first 16 of 32 rows, all output columns of conv2's prefix.
    tensor, region = placed["blocks.2.conv1.weight"]
    assert region[0] == slice(0, 16) and torch.equal(tensor, states[0]["blocks.2.conv1.weight"])
    # The block inserted at index 7 (stage 2, position 1) has no counterpart; the blocks after it shift by one.
    assert not any(key.startswith("blocks.7.") for key in placed)
    assert torch.equal(placed["blocks.8.conv1.weight"][0], states[0]["blocks.7.conv1.weight"])
    assert torch.equal(placed["head.fc.weight"][0], states[0]["head.fc.weight"])
    assert "blocks.0.bn1.num_batches_tracked" not in placed
