"""SubmodelSpec: JSON round trip, a stable id, and clear errors for impossible submodels (METHODS §1.1, §2.a.2)."""

from __future__ import annotations

import json
import math

import pytest

from nestling.errors import ConfigError, SpecError
from nestling.models import ModelConfig
from nestling.spec import SubmodelSpec, width_from_param_fraction

MODEL = ModelConfig("resnet20", num_classes=10, exit_points=(2, 5))


def test_spec_round_trips_through_json_with_the_same_id() -> None:
    spec = SubmodelSpec(MODEL, width=0.5, blocks=(0, 2, 3), depth=6, exits=(2, 5), head=False)
    again = SubmodelSpec.from_dict(json.loads(spec.to_json()))
    assert again == spec and again.id == spec.id and hash(again) == hash(spec)


def test_id_is_a_pure_function_of_the_content() -> None:
    # Hard-coded: the id must not change between runs, machines or Python versions.
    a = SubmodelSpec(ModelConfig("resnet20"), width=0.5)
    assert a.id == SubmodelSpec(ModelConfig("resnet20"), width=0.5).id
    assert len(a.id) == 12 and int(a.id, 16) >= 0
    assert a.id != SubmodelSpec(ModelConfig("resnet20"), width=0.51).id
    assert a.id != SubmodelSpec(ModelConfig("resnet20", learnable_step=False), width=0.5).id


def test_blocks_and_exits_are_normalised_so_equal_sets_give_equal_specs() -> None:
    assert SubmodelSpec(MODEL, blocks=(3, 0, 3, 1)) == SubmodelSpec(MODEL, blocks=(0, 1, 3))
    assert SubmodelSpec(MODEL, exits=(5, 2)).exits == (2, 5)


@pytest.mark.parametrize("width", [0.0, -0.1, 1.5])
def test_width_outside_zero_one_is_refused(width: float) -> None:
    with pytest.raises(SpecError, match="width must be in"):
        SubmodelSpec(MODEL, width=width)


def test_other_impossible_specs_name_their_problem() -> None:
    with pytest.raises(SpecError, match=r"exits \[3\] are not exit points"):
        SubmodelSpec(MODEL, exits=(3,))
    with pytest.raises(SpecError, match="no final head"):
        SubmodelSpec(MODEL, depth=3, exits=(2,))
    with pytest.raises(SpecError, match="at least one exit"):
        SubmodelSpec(MODEL, head=False)
    with pytest.raises(SpecError, match="depth must keep at least one block"):
        SubmodelSpec(MODEL, depth=0, exits=(2,), head=False)
    with pytest.raises(SpecError, match="block_widths"):
        SubmodelSpec(MODEL, block_widths=(0.5, 0.0))


def test_malformed_spec_dicts_raise_spec_or_config_errors() -> None:
    with pytest.raises(SpecError, match="missing the key 'model'"):
        SubmodelSpec.from_dict({"width": 0.5})
    with pytest.raises(ConfigError, match="unknown keys"):
        SubmodelSpec.from_dict({"model": {"arch": "resnet20", "colour": "red"}})


def test_full_spec_keeps_every_exit_and_the_head() -> None:
    full = SubmodelSpec.full(MODEL)
    assert full.exits == (2, 5) and full.head and full.width == 1.0 and full.blocks is None


def test_nefl_parameter_fraction_maps_to_channel_ratio_sqrt() -> None:
    assert width_from_param_fraction(0.34) == pytest.approx(0.5831, abs=1e-4)
    assert width_from_param_fraction(1.0) == 1.0
    assert math.isclose(width_from_param_fraction(0.2) ** 2, 0.2)
    with pytest.raises(SpecError):
        width_from_param_fraction(0.0)


def test_spec_module_imports_on_its_own() -> None:
    """nestling.spec → nestling.models → zoo must not need a half-initialised nestling.spec."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", "import nestling.spec"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
