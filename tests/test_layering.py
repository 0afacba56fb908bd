"""Layers only point down: an AST scan of every module's imports (module- and function-level, importlib strings).

kernel (nestling/*) <- methods (methods/: what each method owns, shared by server and board) <- profiler <- export
<- edge;  methods <- profiler <- server;  simulator and the app entry points (nestling/cli.py) may use everything.
Methods import only the kernel and each other. Also: no bare pre-namespace names (`import server`), and no import
cycles between the modules of one package at module level.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAPPED = ("methods", "server", "edge", "profiler", "export", "simulator")
APP = {"nestling.cli", "nestling.__main__"}
ALLOWED: dict[str, set[str]] = {
    "kernel": {"kernel"},
    "methods": {"kernel", "methods"},
    "profiler": {"kernel", "methods", "profiler"},
    "export": {"kernel", "methods", "profiler", "export"},
    "edge": {"kernel", "methods", "profiler", "export", "edge"},
    "server": {"kernel", "methods", "profiler", "server"},
    "simulator": {"kernel", "methods", "profiler", "export", "edge", "server", "simulator"},
    "app": {"kernel", "methods", "profiler", "export", "edge", "server", "simulator", "app"},
}


@dataclass(frozen=True)
class Arrow:
    """One import: who, what, where, and whether it runs when the module is imported."""

    source: str
    target: str
    line: int
    module_level: bool


def module_files(root: Path) -> dict[str, Path]:
    """Every installed module by dotted name, laid out as the wheel installs it."""
    found: dict[str, Path] = {}
    trees = [(root / "nestling", "nestling")] + [(root / name, f"nestling.{name}") for name in MAPPED]
    for folder, prefix in trees:
        if not folder.is_dir():
            continue
        for path in folder.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((prefix, *parts))] = path
    return found


def layer_of(module: str) -> str:
    if module in APP:
        return "app"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in MAPPED else "kernel"


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def imports_of(module: str, path: Path, known: set[str]) -> list[Arrow]:
    """Imports anywhere in the file; `module_level` is False inside functions and TYPE_CHECKING blocks."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    arrows: list[Arrow] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            inner = inner and not _type_checking_block(child)
            if isinstance(child, ast.Import):
                arrows.extend(Arrow(module, alias.name, child.lineno, top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    stem = ".".join(base + ([child.module] if child.module else []))
                else:
                    stem = child.module or ""
                for alias in child.names:
                    candidate = f"{stem}.{alias.name}"
                    arrows.append(Arrow(module, candidate if candidate in known else stem, child.lineno, top))
            elif (
                isinstance(child, ast.Constant)
                and isinstance(child.value, str)
                and child.value in known
                and child.value != module
            ):
                # a module named as a string: importlib.import_module("..."), lazy tables, entry point maps
                arrows.append(Arrow(module, child.value, child.lineno, False))
            visit(child, inner)

    visit(tree, True)
    return arrows


def upward_arrows(root: Path) -> list[str]:
    files = module_files(root)
    known = set(files)
    problems = []
    for module, path in sorted(files.items()):
        for arrow in imports_of(module, path, known):
            top = arrow.target.split(".")[0]
            if top in MAPPED:
                problems.append(
                    f"{path.relative_to(root)}:{arrow.line} imports the bare old name '{arrow.target}'"
                )
                continue
            if not arrow.target.startswith("nestling.") and arrow.target != "nestling":
                continue
            source, target = layer_of(module), layer_of(arrow.target)
            if target not in ALLOWED[source]:
                where = "" if arrow.module_level else " (inside a function or as a string)"
                problems.append(
                    f"{path.relative_to(root)}:{arrow.line}: {source} -> {target}: imports {arrow.target}{where}"
                )
    return problems


def module_cycles(root: Path) -> list[list[str]]:
    """Strongly connected groups of modules of one layer that import each other when imported."""
    files = module_files(root)
    known = set(files)
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        for arrow in imports_of(module, path, known):
            same_layer = arrow.target in known and layer_of(arrow.target) == layer_of(module)
            # a submodule importing its own package's __init__ is not a cycle the interpreter trips on
            if arrow.module_level and same_layer and not module.startswith(arrow.target + "."):
                graph[module].add(arrow.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return groups


def test_no_layer_imports_upward() -> None:
    problems = upward_arrows(REPO)
    assert not problems, "upward imports:\n" + "\n".join(problems)


def test_no_import_cycles_inside_a_package() -> None:
    cycles = module_cycles(REPO)
    assert not cycles, "module-level import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_function_level_string_and_bare_imports(tmp_path: Path) -> None:
    """The scan itself: an upward arrow hidden in a function, in an importlib string, a bare name, a cycle."""
    (tmp_path / "nestling").mkdir()
    (tmp_path / "nestling" / "__init__.py").write_text("")
    (tmp_path / "nestling" / "spec.py").write_text("import nestling.slicing\n")
    (tmp_path / "nestling" / "slicing.py").write_text("from nestling import spec\n")
    for name in MAPPED:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / "export" / "source.py").write_text(
        "def reopen():\n    from nestling.server.strategies import create\n    return create\n"
    )
    (tmp_path / "server" / "strategies.py").write_text("create = 1\n")
    (tmp_path / "edge" / "cli.py").write_text(
        'import importlib\n\ndef go():\n    return importlib.import_module("nestling.simulator.run")\n'
    )
    (tmp_path / "simulator" / "run.py").write_text("import server\n")
    (tmp_path / "profiler" / "walk.py").write_text("from ..server import strategies\n")
    (tmp_path / "methods" / "growth.py").write_text("from nestling.profiler import walk\n")
    (tmp_path / "nestling" / "heads.py").write_text("def load():\n    import nestling.methods.growth\n")
    (tmp_path / "server" / "plan.py").write_text("import nestling.methods.growth\n")
    problems = "\n".join(upward_arrows(tmp_path))
    assert (
        "export/source.py:2: export -> server: imports nestling.server.strategies (inside a function"
        in problems
    )
    assert "edge/cli.py:4: edge -> simulator: imports nestling.simulator.run" in problems
    assert "simulator/run.py:1 imports the bare old name 'server'" in problems
    assert "profiler/walk.py:1: profiler -> server" in problems
    assert "methods/growth.py:1: methods -> profiler: imports nestling.profiler.walk" in problems
    assert (
        "nestling/heads.py:2: kernel -> methods: imports nestling.methods.growth (inside a function"
        in problems
    )
    assert "server/plan.py" not in problems  # a layer above the methods may use them
    assert module_cycles(tmp_path) == [["nestling.slicing", "nestling.spec"]]
