"""The project's import graph, read statically from the sources: no cycles, and the layering of
shared/design.md (runtime imports none of ours, recipes only runtime, calibration and triton_repo
runtime and recipes, nothing imports builder). Imports inside functions count: a lazy import hides
a cycle from the interpreter until the day someone moves it to the top of its file."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "recipes", "calibration", "triton_repo", "builder", "benchmarks")
# design.md: which of our packages each package may import (its own always)
ALLOWED = {
    "runtime": set(),
    "recipes": {"runtime"},
    "calibration": {"runtime", "recipes"},
    "triton_repo": {"runtime", "recipes"},
    "builder": {"runtime", "recipes", "calibration", "triton_repo"},
    "benchmarks": {"runtime", "recipes", "calibration", "triton_repo", "builder"},  # measures them all
}


def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name`'s file imports anywhere in it (function bodies included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def add(target: str) -> None:
        # `from a.b import c` names module a.b.c when that exists, else a.b; keep the deepest known module
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                add(f"{source}.{alias.name}")
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imported_modules(name, path, set(files)) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None (depth-first search, colouring nodes)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_reader_sees_lazy_and_relative_imports(graph):
    # what the checks below rely on: a relative import inside a function is an edge
    assert "builder.compare" in graph["builder.stages"]
    assert "builder.stages" in graph["builder.run"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_packages_import_only_what_the_design_allows(graph):
    wrong = sorted(f"{mod} imports {dep}" for mod, deps in graph.items() for dep in deps
                   if dep.split(".")[0] not in ALLOWED[mod.split(".")[0]] | {mod.split(".")[0]})
    assert not wrong, "imports outside shared/design.md's layering:\n  " + "\n  ".join(wrong)


def test_benchmarks_import_as_a_package():
    """Every benchmark runs as `python -m benchmarks.NAME`: no sys.path edits, no bare sibling imports."""
    files = module_files()
    siblings = {n.rpartition(".")[2] for n in files if n.startswith("benchmarks.")}
    wrong = []
    for name, path in files.items():
        if not name.startswith("benchmarks"):
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
                wrong.append(f"{name}: sys.path, line {node.lineno}")
            elif isinstance(node, ast.Import | ast.ImportFrom) and not getattr(node, "level", 0):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                wrong += [f"{name}: bare import of {n}, line {node.lineno}" for n in names if n.split(".")[0] in siblings]
    assert not wrong, "\n".join(wrong)


# design.md: runtime runs on the GPU machine with only these (and the standard library) installed
RUNTIME_THIRD_PARTY = {"torch", "triton", "numpy", "safetensors"}


def test_runtime_needs_only_torch_triton_numpy_safetensors():
    """An import in runtime/ of anything but the standard library, our own runtime and the four packages the GPU
    machine has fails here (pydantic or yaml would break `import runtime` there), unless it sits in a
    `try: ... except ImportError` that does without it."""
    import sys

    def optional(tree: ast.AST) -> set[int]:
        """ids of import nodes inside a try whose handlers catch ImportError."""
        out = set()
        for t in ast.walk(tree):
            if isinstance(t, ast.Try) and any(
                    isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                    for h in t.handlers):
                out |= {id(n) for stmt in t.body for n in ast.walk(stmt)}
        return out

    bad = []
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        skip = optional(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for top in {n.split(".")[0] for n in names if n}:
                if top not in sys.stdlib_module_names and top != "runtime" and top not in RUNTIME_THIRD_PARTY:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {top}")
    assert not bad, bad
