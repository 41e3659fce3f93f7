"""The package's structure, as drawn from its source: layers, no circles, no reach into other objects' privates.

What is checked (``docs/design.md`` shows the map it enforces):

* **no import circles**, module by module, and **none between packages**
  (each subpackage one node: ``engine.memory`` and ``engine.optim`` may not
  import each other, even through their ``__init__``);
* **layers**: ``plan`` (pure) <- ``engine`` <- ``integrations``, and inside the
  engine the order of :data:`ENGINE_LAYERS` (a part imports only parts of its
  own layer or below);
* **strategies behind the registry** (:data:`STRATEGIES`): a strategy's
  internals (its strategy module, its backend class) are imported only by its
  own modules (the strategy module, its fence package) and by the registry
  (:data:`REGISTRY`); everything else reaches a strategy through the registry;
* **privacy**, outside the fence modules (:data:`FENCES`: the only modules that
  may touch the private names of torch, Accelerate and transformers):
  no read of another object's underscore attribute (``other._x``, or
  ``getattr(obj, "_x")``); no ``self._x`` that the class (or a base class of
  this package) does not define itself, i.e. no private name inherited from a
  foreign class (``Accelerator._optimizers``); no underscore name imported from
  another module (``from .m import _helper``); no underscore module imported
  from outside its own package.

Every ``import`` statement counts, at any level (inside functions and
``if TYPE_CHECKING:`` blocks too): an import hidden in a function is still a
dependency, and hiding one to dodge a circle is what this forbids. Modules are
split by concept, not by size: there is no line cap.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_altparams"

#: The modules (or packages) allowed to touch private names of torch, Accelerate and transformers.
FENCES = (
    "hf_altparams.engine.ddp",  # DDP's reducer surgery (package)
    "hf_altparams.engine.fsdp2",  # FSDP2's and DTensor's state (package)
    "hf_altparams.engine.deepspeed",  # DeepSpeed ZeRO's optimizer partitions and comm (package)
    "hf_altparams.engine.torch_internals",  # the few other torch private names
    "hf_altparams.integrations.accelerate_internals",
    "hf_altparams.integrations.transformers_internals",
)

#: Documented public names of the standard library that begin with an underscore (not private, despite it).
PUBLIC_UNDERSCORE_NAMES = frozenset({"os._exit"})

#: The engine's parts, bottom to top: a part may import parts of its own layer or of the layers below.
ENGINE_LAYERS: tuple[tuple[str, ...], ...] = (
    ("records", "digest", "collective", "torch_internals", "layouts", "driver", "backend"),
    ("ddp", "fsdp2"),
    ("memory", "comm", "shutdown"),
    ("optim", "buffers", "drift", "invariants", "prefix", "deepspeed"),
    ("config", "report"),
    ("strategies",),
    ("switch",),
)

#: The strategy registry: the one module besides a strategy's own that imports the strategy's internals.
REGISTRY = "hf_altparams.engine.strategies"

#: Per strategy: its own modules (prefixes: its strategy module, its fence package) and its internals, the
#: modules or names no other module but :data:`REGISTRY` imports.
STRATEGIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "local": (("hf_altparams.engine.strategies.local",), ("hf_altparams.engine.strategies.local",)),
    "ddp": (
        ("hf_altparams.engine.strategies.ddp", "hf_altparams.engine.ddp"),
        ("hf_altparams.engine.strategies.ddp", "hf_altparams.engine.ddp.DDPBackend"),
    ),
    "fsdp2": (
        ("hf_altparams.engine.strategies.fsdp2", "hf_altparams.engine.fsdp2"),
        ("hf_altparams.engine.strategies.fsdp2", "hf_altparams.engine.fsdp2.FSDP2Backend"),
    ),
}
#: The DeepSpeed ZeRO strategies (one per stage) share their module, fence package and internals.
_ZERO = (
    ("hf_altparams.engine.strategies.deepspeed", "hf_altparams.engine.deepspeed"),
    (
        "hf_altparams.engine.strategies.deepspeed",
        "hf_altparams.engine.deepspeed.ZeroBackend",
        "hf_altparams.engine.deepspeed.ZeroStateOwner",
        "hf_altparams.engine.deepspeed._backend",
        "hf_altparams.engine.deepspeed._partitions",
        "hf_altparams.engine.deepspeed._surface",
    ),
)
STRATEGIES.update({"zero1": _ZERO, "zero2": _ZERO, "zero3": _ZERO})


# ---------------------------------------------------------------------------- the module graph
def _modules(root: Path = PACKAGE) -> dict[str, Path]:
    found = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _package_of(name: str, path: Path) -> list[str]:
    return name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]


def _imports(
    name: str, path: Path, modules: dict[str, Path], tree: Optional[ast.AST] = None
) -> list[tuple[ast.AST, str, list[str]]]:
    """``(node, target module, imported names)`` for every import statement of module ``name``."""
    package = _package_of(name, path)
    out = []
    for node in ast.walk(tree if tree is not None else ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            for alias in node.names:
                candidate = f"{prefix}.{alias.name}"
                out.append((node, candidate if candidate in modules else prefix, [alias.name]))
    return out


def _graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    modules = _modules(root)
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for _, target, _ in _imports(name, path, modules):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges[name].add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(edges.get(node, ())):
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


def _node(name: str, packages: set[str]) -> str:
    """The package-level node of module ``name``: the subpackage holding it, or itself when none does."""
    return next((p for p in sorted(packages, key=len) if name == p or name.startswith(p + ".")), name)


def _package_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each subpackage (a folder below ``hf_altparams``) as one node; modules directly in a folder that has
    subpackages stay their own nodes (``engine.switch``, ``engine.backend``)."""
    packages = {name for name, path in _modules().items() if path.name == "__init__.py" and name.count(".") >= 2}
    out: dict[str, set[str]] = {}
    for name, targets in edges.items():
        node = _node(name, packages)
        out.setdefault(node, set())
        for target in targets:
            other = _node(target, packages)
            if other != node:
                out[node].add(other)
    return out


def test_the_graph_sees_imports_inside_functions_and_type_checking_blocks() -> None:
    edges = _graph()
    assert "hf_altparams.engine.switch" in edges["hf_altparams.engine"]
    assert "hf_altparams.engine.config" in edges["hf_altparams.engine.switch"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles() -> None:
    assert _cycles(_graph()) == []


def test_no_circles_between_packages() -> None:
    graph = _package_graph(_graph())
    assert "hf_altparams.engine.memory" in graph and "hf_altparams.engine.optim" in graph
    assert "hf_altparams.engine.memory" in graph["hf_altparams.engine.optim"]  # optim builds on memory
    assert _cycles(graph) == []
    # A circle between two packages that no module-level circle shows is caught.
    crossed = {
        "hf_altparams.engine.memory.model": {"hf_altparams.engine.optim.idle"},
        "hf_altparams.engine.optim.precision": {"hf_altparams.engine.memory.release"},
    }
    assert _cycles(crossed) == []
    assert _cycles(_package_graph(crossed)) == [["hf_altparams.engine.memory", "hf_altparams.engine.optim"]]


def test_layers_depend_downwards_only() -> None:
    """plan (pure) <- engine (torch.distributed) <- integrations (Accelerate, Trainer) <- check; planner beside."""

    def within(name: str, package: str) -> bool:
        return name == package or name.startswith(package + ".")

    edges = _graph()
    for name, targets in edges.items():
        if within(name, "hf_altparams.plan"):
            assert not any(
                within(t, "hf_altparams.engine") or within(t, "hf_altparams.integrations") for t in targets
            ), name
        if within(name, "hf_altparams.engine"):
            assert not any(within(t, "hf_altparams.integrations") for t in targets), name
        if within(name, "hf_altparams.planner"):  # arithmetic over the plan: no run, no integration
            assert not any(
                within(t, "hf_altparams.integrations") or within(t, "hf_altparams.check") for t in targets
            ), name
        if not within(name, "hf_altparams.check") and name != "hf_altparams.__main__":
            assert not any(within(t, "hf_altparams.check") for t in targets), name  # the top: only the CLI uses it


def _engine_part(name: str) -> Optional[str]:
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["hf_altparams", "engine"] else None


def test_engine_parts_import_their_layer_or_below() -> None:
    level = {part: i for i, layer in enumerate(ENGINE_LAYERS) for part in layer}
    modules = _modules()
    engine_parts = {_engine_part(n) for n in modules} - {None}
    assert engine_parts == set(level), f"parts without a layer: {engine_parts ^ set(level)}"
    wrong = []
    for name, targets in _graph().items():
        mine = _engine_part(name)
        if mine is None:
            continue
        for target in targets:
            theirs = _engine_part(target)
            if theirs is not None and theirs != mine and level[theirs] > level[mine]:
                wrong.append(f"{name} -> {target}")
    assert wrong == []


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def strategy_findings(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Every import of a strategy's internals outside its own modules and the registry."""
    modules = {
        name: Path(name.replace(".", "/") + ("/__init__.py" if is_init else ".py"))
        for name, (_, is_init) in sources.items()
    }
    found: list[str] = []
    for name, (source, _) in sources.items():
        if name == REGISTRY:
            continue
        for _, target, names in _imports(name, modules[name], modules, ast.parse(source)):
            imported = [target] + [f"{target}.{n}" for n in names]
            for strategy, (own, internals) in STRATEGIES.items():
                if _within(name, own):
                    continue
                hit = [i for i in imported if _within(i, internals)]
                if hit:
                    found.append(
                        f"{name}: imports {hit[0]}, an internal of the {strategy!r} strategy (reach it "
                        f"through the registry, {REGISTRY})"
                    )
    return found


def test_the_strategy_rule_catches_an_import_of_a_strategys_internals() -> None:
    sources = {
        REGISTRY: ("from .ddp import DDPStrategy\nfrom . import fsdp2\n", True),
        "hf_altparams.engine.strategies.ddp": ("from ..ddp import DDPBackend, is_ddp\n", False),
        "hf_altparams.engine.strategies.fsdp2": ("x = 1\n", False),
        "hf_altparams.engine.strategies.local": ("x = 1\n", False),
        "hf_altparams.engine.ddp": ("from ._backend import DDPBackend\n", True),
        "hf_altparams.engine.ddp._backend": ("class DDPBackend: ...\n", False),
        "hf_altparams.engine.fsdp2": ("class FSDP2Backend: ...\n", True),
        "hf_altparams.engine.switch": (
            "from .ddp import is_ddp\nfrom .strategies import strategy_for\nfrom .strategies.ddp import DDPStrategy\n",
            False,
        ),
        "hf_altparams.integrations.x": (
            "from ..engine.ddp import DDPBackend\n"
            "import hf_altparams.engine.strategies.local\n"
            "from ..engine.fsdp2 import FSDP2Backend as B\n",
            False,
        ),
    }
    found = strategy_findings(sources)
    assert len(found) == 4, found
    assert any(f.startswith("hf_altparams.engine.switch: imports hf_altparams.engine.strategies.ddp") for f in found)
    assert any("integrations.x: imports hf_altparams.engine.ddp.DDPBackend" in f for f in found)
    assert any("integrations.x: imports hf_altparams.engine.strategies.local" in f for f in found)
    assert any("integrations.x: imports hf_altparams.engine.fsdp2.FSDP2Backend" in f for f in found)


def test_only_the_registry_reaches_a_strategys_internals() -> None:
    from hf_altparams.engine.strategies import registered

    assert {s.name for s in registered()} == set(STRATEGIES)  # every registered strategy has its rule here
    modules = _modules()
    for own, internals in STRATEGIES.values():
        assert all(any(_within(m, (o,)) for m in modules) for o in own), own
    sources = {name: (path.read_text(), path.name == "__init__.py") for name, path in modules.items()}
    assert strategy_findings(sources) == []


# ---------------------------------------------------------------------------- privacy
def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _fenced(name: str) -> bool:
    return any(name == fence or name.startswith(fence + ".") for fence in FENCES)


def _own_names(tree: ast.AST) -> dict[str, tuple[set[str], list[str]]]:
    """Per class of a module: the underscore names it defines itself, and its base classes' simple names."""
    out: dict[str, tuple[set[str], list[str]]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        defined: set[str] = set()
        for item in ast.walk(node):
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_private(item.name):
                defined.add(item.name)
            targets: list[ast.AST] = []
            if isinstance(item, ast.Assign):
                targets = list(item.targets)
            elif isinstance(item, (ast.AnnAssign, ast.AugAssign)):
                targets = [item.target]
            for target in targets:
                for sub in ast.walk(target):
                    if (
                        isinstance(sub, ast.Attribute)
                        and isinstance(sub.value, ast.Name)
                        and sub.value.id in ("self", "cls")
                        and _is_private(sub.attr)
                    ):
                        defined.add(sub.attr)
                    elif isinstance(sub, ast.Name) and _is_private(sub.id):
                        defined.add(sub.id)
        bases = [
            b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in node.bases
        ]
        out[node.name] = (defined, bases)
    return out


def privacy_findings(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Every breach of the privacy rules in ``sources`` (module name -> (source, is a package ``__init__``))."""
    trees = {name: ast.parse(source) for name, (source, _) in sources.items()}
    classes: dict[str, tuple[set[str], list[str]]] = {}
    for tree in trees.values():
        classes.update(_own_names(tree))

    def inherited(cls: str, seen: frozenset[str] = frozenset()) -> set[str]:
        own, bases = classes.get(cls, (set(), []))
        names = set(own)
        for base in bases:
            if base in classes and base not in seen:
                names |= inherited(base, seen | {cls})
        return names

    modules = {
        name: Path(name.replace(".", "/") + ("/__init__.py" if is_init else ".py"))
        for name, (_, is_init) in sources.items()
    }
    found: list[str] = []
    for name, tree in trees.items():
        if _fenced(name):
            continue
        package = _package_of(name, modules[name])
        for node, target, names in _imports(name, modules[name], modules, tree):
            for imported in names:
                if _is_private(imported):
                    found.append(f"{name}: imports the underscore name {imported!r} from {target}")
            parts = target.split(".")
            for depth, part in enumerate(parts):
                if _is_private(part):
                    owner = parts[:depth]
                    if parts[0] == "hf_altparams" and package[: len(owner)] != owner:
                        found.append(f"{name}: imports {target}, a private module of another package")
                    break
        for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            mine = inherited(cls.name)
            for node in ast.walk(cls):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id in ("self", "cls")
                    and _is_private(node.attr)
                    and node.attr not in mine
                ):
                    found.append(
                        f"{name}:{node.lineno}: {cls.name} uses {node.value.id}.{node.attr}, which it "
                        "does not define (a foreign class's private name)"
                    )
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and _is_private(node.attr)
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                and ast.unparse(node) not in PUBLIC_UNDERSCORE_NAMES
            ):
                found.append(f"{name}:{node.lineno}: reads {ast.unparse(node)}, another object's private attribute")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and _is_private(node.args[1].value)
            ):
                found.append(f"{name}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r}), a private attribute")
    return found


def test_the_privacy_check_catches_each_kind_of_breach() -> None:
    sources = {
        "hf_altparams.a": (
            """
from .b import _helper
from ._private import thing
import torch

class Mine:
    def __init__(self):
        self._own = 1
    def _method(self):
        return self._own + self._method2()
    def _method2(self):
        return 0

class Sub(Mine, torch.optim.Optimizer):
    def f(self, other):
        getattr(other, "_hidden")
        return other._x, self._own, self._foreign
""",
            False,
        ),
        "hf_altparams.b": ("def _helper():\n    return 1\n", False),
        "hf_altparams._private": ("thing = 1\n", False),
        "hf_altparams.engine.ddp.x": ("def f(ddp):\n    return ddp._module_parameters\n", False),
    }
    found = privacy_findings(sources)
    assert any("'_helper'" in f for f in found)
    assert not any("hf_altparams._private" in f for f in found)  # a private module of the same package
    assert any("getattr(..., '_hidden')" in f for f in found)
    assert any("other._x" in f for f in found)
    assert any("self._foreign" in f for f in found)
    assert not any("self._own" in f or "self._method2" in f for f in found)  # its own, and its base's
    assert not any("engine.ddp" in f for f in found)  # inside a fence
    assert len(found) == 4, found
    outside = {
        "hf_altparams.integrations.x": ("from ..engine.memory._secret import y\n", False),
        "hf_altparams.engine.memory._secret": ("y = 1\n", False),
    }
    assert any("private module of another package" in f for f in privacy_findings(outside))


def test_no_module_reaches_into_another_objects_privates() -> None:
    sources = {name: (path.read_text(), path.name == "__init__.py") for name, path in _modules().items()}
    assert privacy_findings(sources) == []


@pytest.mark.parametrize("fence", FENCES)
def test_every_fence_exists(fence: str) -> None:
    assert fence in _modules(), f"{fence} is listed as a fence but is not a module or package"


# ---------------------------------------------------------------------------- optional libraries behind their fence
#: Libraries only their fence imports (optional ones: the rest of the package must import without them).
FENCED_LIBRARIES = {"deepspeed": "hf_altparams.engine.deepspeed"}


def library_findings(sources: dict[str, str]) -> list[str]:
    """Every import of a :data:`FENCED_LIBRARIES` library outside its fence."""
    found = []
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            targets = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            for target in targets:
                library = target.split(".")[0]
                fence = FENCED_LIBRARIES.get(library)
                if fence is not None and not _within(name, (fence,)):
                    found.append(f"{name}: imports {target}, which only {fence} may import")
    return found


def test_the_library_rule_catches_an_import_outside_the_fence() -> None:
    found = library_findings(
        {
            "hf_altparams.engine.deepspeed._surface": "import deepspeed.comm.comm as comm\n",
            "hf_altparams.integrations.x": "def f():\n    from deepspeed.runtime.zero import stage_1_and_2\n",
            "hf_altparams.engine.switch": "import deepspeed\n",
        }
    )
    assert sorted(f.split(":")[0] for f in found) == ["hf_altparams.engine.switch", "hf_altparams.integrations.x"]


def test_only_the_fence_imports_deepspeed() -> None:
    assert library_findings({name: path.read_text() for name, path in _modules().items()}) == []
