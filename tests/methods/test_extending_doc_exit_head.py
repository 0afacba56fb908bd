"""docs/extending.md's exit-head example runs as written: it registers, builds, trains and exports with parity."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from nestling.models.heads import registered_exit_heads, unregister_exit_head

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "extending.md"
NAME = "maxpool-exit"


def _section() -> str:
    text = GUIDE.read_text()
    start = text.index("## Adding an exit head")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


@pytest.fixture
def namespace() -> Iterator[dict[str, Any]]:
    assert NAME not in registered_exit_heads(), f"'{NAME}' is taken: the example must not replace a real head"
    scope: dict[str, Any] = {}
    yield scope
    unregister_exit_head(NAME)  # only ever the example's own head (checked above)


def test_the_exit_head_example_runs_and_its_head_trains_and_exports(namespace: dict[str, Any]) -> None:
    from nestling.export.standalone import build_standalone, plan_outputs, reference_outputs

    blocks = re.findall(r"```python\n(.*?)```", _section(), flags=re.S)
    assert len(blocks) == 2
    for block in blocks:
        exec(compile(block, str(GUIDE), "exec"), namespace)  # the guide's own code
    net = namespace["net"]
    assert [type(net.exits[k]).__name__ for k in ("2", "5")] == ["MaxPoolExit", "MaxPoolExit"]
    outputs = net(torch.randn(4, 3, 8, 8))
    assert len(outputs) == 3
    sum(o.sum() for o in outputs).backward()
    net.eval()
    plan = plan_outputs(net, all_exits=True)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        for got, expected in zip(build_standalone(net, plan)(x), reference_outputs(net, plan, x)):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
