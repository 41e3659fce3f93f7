"""The package's structure, as drawn from its imports: no import circles, small modules.

Every ``import`` statement of the package counts, at any level (inside
functions and ``if TYPE_CHECKING:`` blocks too): an import hidden in a function
is still a dependency, and hiding one to dodge a circle is what this forbids.
An edge goes to the module named (``from .memory._report import X`` ->
``engine.memory._report``; ``from ..engine import optim`` -> ``engine.optim``),
not to the packages above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_altparams"
#: "modules under ~400 lines, split by responsibility": a little slack for a docstring.
MAX_LINES = 420


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - (node.level - 1)]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                for alias in node.names:
                    candidate = f"{prefix}.{alias.name}"
                    targets.append(candidate if candidate in modules else prefix)
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(edges[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_imports_inside_functions_and_type_checking_blocks(tmp_path: Path) -> None:
    edges = _graph()
    assert "hf_altparams.engine.switch" in edges["hf_altparams.engine"]
    assert "hf_altparams.engine.config" in edges["hf_altparams.engine.switch"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles() -> None:
    assert _cycles(_graph()) == []


def test_layers_depend_downwards_only() -> None:
    """plan (pure) <- engine (torch.distributed) <- integrations (Accelerate, Trainer)."""
    def within(name: str, package: str) -> bool:
        return name == package or name.startswith(package + ".")

    edges = _graph()
    for name, targets in edges.items():
        if within(name, "hf_altparams.plan"):
            assert not any(within(t, "hf_altparams.engine") or within(t, "hf_altparams.integrations")
                           for t in targets), name
        if within(name, "hf_altparams.engine"):
            assert not any(within(t, "hf_altparams.integrations") for t in targets), name


@pytest.mark.parametrize("name", sorted(_modules()))
def test_modules_stay_small(name: str) -> None:
    lines = len(_modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines; split it by responsibility"
