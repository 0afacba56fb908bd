"""docs/extending.md's worked example runs as written: its family registers, builds, estimates and exports."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from nestling.models.family import unregister_family

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "extending.md"


def _family_section() -> str:
    text = GUIDE.read_text()
    start = text.index("## Adding a model family")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


@pytest.fixture
def namespace() -> Iterator[dict[str, Any]]:
    scope: dict[str, Any] = {}
    yield scope
    unregister_family("mlp3")


def test_the_model_family_example_runs_and_its_family_works_everywhere(namespace: dict[str, Any]) -> None:
    blocks = re.findall(r"```python\n(.*?)```", _family_section(), flags=re.S)
    assert len(blocks) == 2
    assert "def walk" not in blocks[0] and "def standalone_part" not in blocks[0]  # a family is its modules
    for block in blocks:
        exec(compile(block, str(GUIDE), "exec"), namespace)  # the guide's own code
    net = namespace["net"]
    assert net(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    assert net.blocks[1].skipped

    from nestling.export.standalone import build_standalone, plan_outputs
    from nestling.models.cost import count_parameters

    spec = namespace["spec"]
    from nestling.profiler.measure import profile_model

    cost = namespace["estimate"](spec, 4)
    assert cost.params == count_parameters(net)
    measured = profile_model(spec, 4, repeats=1, warmup=0, rss_check=False)
    assert cost.activation_bytes == measured["total"]["activations_bytes"]
    net.eval()
    standalone = build_standalone(net, plan_outputs(net))
    x = torch.randn(3, 1, 8, 8)
    torch.testing.assert_close(standalone(x), net(x))
