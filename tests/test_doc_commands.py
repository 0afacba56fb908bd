"""Every fenced ```bash block of README.md and docs/*.md runs as printed, so a doc cannot drift from the CLI.

The blocks run in document order (README first, then docs/ by name) in one sandbox that looks like the
repository root after `bash scripts/setup.sh` (`.venv` and `scripts/` linked, `examples/` copied), so a later
block may use what an earlier one made (the Quickstart's runs/nefl is exported further down). `nestling`
commands run in this process (one torch import for all of them); anything else runs under bash.

Conventions for doc writers:
- A block that cannot run here (needs root, a board, a GPU, a broker left running, minutes or hours) is
  preceded by the line `<!-- not-tested: <reason> -->`; the skip and its reason show in pytest's summary
  (`-rs`), and a marker without a reason fails.
- A command whose comment (on its line or the comment line just above) says "e.g." shows a realistic size:
  it runs with tiny settings (`TINY` below: fewer rounds, a data subset, fewer timing repeats), nothing else
  changed. Everything else runs exactly as printed.
- A few inputs stand for the user's own files; the sandbox provides them (`PLACEHOLDERS`).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from nestling.cli import main

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(bash|sh|shell)\s*$")
MARKER = re.compile(r"^<!--\s*not-tested:(.*?)-->\s*$")

# Tiny settings for "e.g." commands: flag -> value (replaced when the command gives the flag, else added).
TINY: dict[str, dict[str, str | None]] = {
    "simulate": {
        "--rounds": "1",
        "--fraction": "0.1",
        "--limit-train": "240",
        "--limit-test": "120",
        "--local-steps": "1",
        "--workers": "1",
        "--eval-every": "1",
        "--quiet": None,
    },
    "profile": {"--repeats": "1", "--warmup": "0", "--gflops-seconds": "0.05"},
    "export": {"--calib-samples": "32", "--eval-samples": "64", "--no-benchmark": None},
}


@dataclass
class DocBlock:
    doc: str
    line: int
    skip: str | None  # the not-tested reason ("" when the marker gives none)
    commands: list[tuple[str, bool]]  # (command, "e.g." marks it)

    @property
    def label(self) -> str:
        return f"{self.doc}:{self.line}"


def read_blocks(path: Path) -> list[DocBlock]:
    """The bash blocks of one doc: each command (continuation lines joined) and whether it says e.g."""
    lines = path.read_text().splitlines()
    blocks: list[DocBlock] = []
    index = 0
    while index < len(lines):
        if not FENCE.match(lines[index]):
            index += 1
            continue
        above = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        marker = MARKER.match(above.strip())
        start, index = index + 1, index + 1
        body: list[str] = []
        while index < len(lines) and not lines[index].startswith("```"):
            body.append(lines[index])
            index += 1
        index += 1
        commands: list[tuple[str, bool]] = []
        pending, comment_says_eg = "", False
        for raw in body:
            stripped = raw.strip()
            if not pending and stripped.startswith("#"):
                comment_says_eg = comment_says_eg or "e.g." in stripped  # over all comment lines above
                continue
            if not stripped and not pending:
                comment_says_eg = False
                continue
            pending += (" " if pending else "") + stripped.rstrip("\\").rstrip()
            if stripped.endswith("\\"):
                continue
            commands.append((pending, comment_says_eg or "e.g." in pending))
            pending, comment_says_eg = "", False
        name = str(path.relative_to(REPO))
        blocks.append(DocBlock(name, start, marker.group(1).strip() if marker else None, commands))
    return blocks


BLOCKS = [block for doc in DOCS for block in read_blocks(doc)]


def tiny(argv: list[str]) -> list[str]:
    """`argv` (nestling's arguments) with the TINY settings of its subcommand."""
    settings = TINY.get(argv[0], {})
    if argv[0] == "simulate" and "--resume" in argv:
        return argv  # a resumed run keeps the settings it was started with
    out = list(argv)
    for flag, value in settings.items():
        if flag in out:
            if value is not None:
                out[out.index(flag) + 1] = value
        else:
            out += [flag] if value is None else [flag, value]
    return out


def placeholder_image(path: Path) -> None:
    """image.png: a handwritten digit from scikit-learn, as a user's own image would be."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digit = load_digits().images[0]  # 8x8, 0..16
    Image.fromarray((digit * 255 / 16).astype(np.uint8)).resize((32, 32)).save(path)


PLACEHOLDERS = {"image.png": placeholder_image}


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo-root")
    for name in (".venv", "scripts", "benchmarks", "pyproject.toml"):
        if (REPO / name).exists():
            (root / name).symlink_to(REPO / name)
    shutil.copytree(REPO / "examples", root / "examples")
    for name, make in PLACEHOLDERS.items():
        make(root / name)
    return root


def run_command(command: str, says_eg: bool, cwd: Path) -> None:
    argv = shlex.split(command, comments=True)
    if argv and Path(argv[0]).name == "nestling" and argv[0] in ("nestling", ".venv/bin/nestling"):
        args = tiny(argv[1:]) if says_eg else argv[1:]
        code = main(args)
        assert code == 0, f"`{command}` exited {code}" + (
            f" (ran as nestling {' '.join(args)})" if says_eg else ""
        )
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (
        f"`{command}` exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    )


@pytest.mark.parametrize("block", BLOCKS, ids=[b.label for b in BLOCKS])
def test_doc_block_runs_as_printed(block: DocBlock, sandbox: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if block.skip is not None:
        assert block.skip, f"{block.label}: a not-tested marker must say why"
        pytest.skip(f"not-tested: {block.skip}")
    monkeypatch.chdir(sandbox)
    monkeypatch.setenv("COLUMNS", "160")
    for command, says_eg in block.commands:
        run_command(command, says_eg, sandbox)


def test_blocks_were_found() -> None:
    assert len(BLOCKS) >= 10 and any(b.doc == "README.md" and b.skip is None for b in BLOCKS)


def test_what_the_docs_write_is_git_ignored() -> None:
    """Every relative --out of a documented command lands in a path the repository's .gitignore covers."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    outs: set[str] = set()
    for block in BLOCKS:
        for command, _ in block.commands:
            argv = shlex.split(command, comments=True)
            outs.update(
                argv[i + 1]
                for i, a in enumerate(argv[:-1])
                if a == "--out" and not argv[i + 1].startswith("/")
            )
    outs = {o for o in outs if o.isascii() and not o.isupper()}  # DIR, X: prose placeholders
    assert outs
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", "--verbose", "--non-matching", *sorted(outs)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    missing = [line.split("\t")[-1] for line in done.stdout.splitlines() if line.startswith("::")]
    assert not missing, f"not in .gitignore: {missing}"
