"""Compares a stub package of ours (``typings/<library>``) with the installed library it stands for.

mypy believes a stub without looking at the library: a name, attribute,
method or parameter written there that the library lacks (or lost in a
release) would let a wrong call pass the type check and fail in a user's run.
:func:`stub_problems` reads each stub module (``ast``) and compares it with the
module it stands for:

* every class, function, module attribute and re-export exists (a re-export is
  the very object of the module it comes from);
* a class's bases are among the real class's bases, a ``@dataclass`` is one;
  an enum member has the real member's value;
* an attribute exists on the class, as a dataclass field, on a live object
  (one the test builds) or is assigned to ``self`` in the class's source; a
  property is a property (with a setter where the stub writes one), a static
  method a static method, a class method a class method;
* a function's (or method's) parameters: every name in the stub is a parameter
  of the real one, the positional ones in the same order; ``*args`` /
  ``**kwargs`` only where the real one has them; every parameter the real one
  requires is in the stub, without a default; a keyword-only one stays keyword-only.

Types are not compared: the stubs' types are written from the library's source
(or its own annotations). :func:`edited_stubs` makes a copy of a stub with one
edit, for a test that the comparison catches it. Used by ``tests/integrations/test_accelerate_stubs.py``,
``test_transformers_stubs.py`` and ``test_peft_stubs.py``.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import importlib.util
import inspect
import re
import shutil
from pathlib import Path
from typing import Any

__all__ = ["edited_stubs", "stub_problems"]


# ------------------------------------------------------------------ reading the stub
def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _decorators(node: ast.FunctionDef | ast.ClassDef) -> list[str]:
    return [ast.unparse(d) for d in node.decorator_list]


def _base_name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else ast.unparse(node)


# ------------------------------------------------------------------ comparing a signature
def _undecorated(function: Any, name: str) -> Any:
    """``function``, or the function of that name a decorator's closure holds (e.g. Accelerate's ``@on_main_process``
    wraps ``log`` and ``init_trackers`` in an ``_inner(*args, **kwargs)`` without ``functools.wraps``)."""
    if getattr(function, "__name__", name) == name:
        return function
    for cell in getattr(function, "__closure__", None) or ():
        inner = cell.cell_contents
        if inspect.isfunction(inner) and inner.__name__ == name:
            return inner
    return function


def _signature_problems(where: str, real: Any, node: ast.FunctionDef, lib: str) -> list[str]:
    real = _undecorated(real, node.name)
    try:
        signature = inspect.signature(real)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to compare
        return []
    params = signature.parameters
    kinds = {p.kind for p in params.values()}
    args = node.args
    positional = [a.arg for a in args.posonlyargs + args.args]
    keyword_only = [a.arg for a in args.kwonlyargs]
    with_default = set(positional[len(positional) - len(args.defaults) :]) | {
        a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None
    }
    problems = []
    for name in positional + keyword_only:
        if name not in params:
            problems.append(f"{where}: parameter {name!r} is not one of {list(params)}")
    real_positional = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if positional != real_positional[: len(positional)]:
        problems.append(f"{where}: positional parameters {positional}, the real ones start {real_positional}")
    for name in positional:
        if name in params and params[name].kind is inspect.Parameter.KEYWORD_ONLY:
            problems.append(f"{where}: parameter {name!r} is keyword-only in {lib}, positional in the stub")
    if args.vararg is not None and inspect.Parameter.VAR_POSITIONAL not in kinds:
        problems.append(f"{where}: the stub takes *{args.vararg.arg}, {lib} does not")
    if args.kwarg is not None and inspect.Parameter.VAR_KEYWORD not in kinds:
        problems.append(f"{where}: the stub takes **{args.kwarg.arg}, {lib} does not")
    for name, param in params.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or param.default is not param.empty:
            continue
        if name not in positional + keyword_only:
            problems.append(f"{where}: {lib} requires parameter {name!r}, the stub lacks it")
        elif name in with_default:
            problems.append(f"{where}: {lib} requires parameter {name!r}, the stub gives it a default")
    return problems


# ------------------------------------------------------------------ comparing a class
def _has_attribute(cls: type, name: str, live: dict[str, Any], package: str) -> bool:
    if hasattr(cls, name):
        return True
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    if cls.__name__ in live and hasattr(live[cls.__name__], name):
        return True
    # `self.name = ...`, `self.name: T = ...`, or `self.a, self.name = ...` (a target of a tuple assignment)
    one = rf"\bself\.{re.escape(name)}\s*(:[^=\n]*)?=[^=]"
    among = rf"^\s*(self\.\w+\s*,\s*)*self\.{re.escape(name)}\s*(,\s*self\.\w+\s*)*=[^=]"
    assigned = re.compile(f"{one}|{among}", re.M)
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] != package:
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if assigned.search(source):
            return True
    return False


def _class_problems(
    where: str, cls: Any, node: ast.ClassDef, live: dict[str, Any], lib: str, package: str
) -> list[str]:
    if not inspect.isclass(cls):
        return [f"{where}: not a class in {lib} ({type(cls).__name__})"]
    problems = []
    real_bases = {klass.__name__ for klass in cls.__mro__[1:]}
    for base in node.bases:
        if _base_name(base) not in real_bases:
            problems.append(f"{where}: base {_base_name(base)} is not among {sorted(real_bases)}")
    if "dataclass" in _decorators(node) and not dataclasses.is_dataclass(cls):
        problems.append(f"{where}: a @dataclass in the stub, not in {lib}")
    for item in node.body:
        if isinstance(item, ast.Assign) and issubclass(cls, enum.Enum):  # an enum member
            for target in item.targets:
                assert isinstance(target, ast.Name) and isinstance(item.value, ast.Constant)
                member = cls.__members__.get(target.id)
                if member is None or member.value != item.value.value:
                    problems.append(f"{where}.{target.id}: no such member with value {item.value.value!r}")
        elif isinstance(item, ast.AnnAssign):
            assert isinstance(item.target, ast.Name)
            if not _has_attribute(cls, item.target.id, live, package):
                problems.append(f"{where}.{item.target.id}: no such attribute")
        elif isinstance(item, ast.FunctionDef):
            problems += _method_problems(f"{where}.{item.name}", cls, item, lib)
    return problems


def _method_problems(where: str, cls: type, node: ast.FunctionDef, lib: str) -> list[str]:
    decorators = _decorators(node)
    real = None
    for klass in cls.__mro__:
        if node.name in vars(klass):
            real = vars(klass)[node.name]
            break
    if real is None:
        return [f"{where}: no such method or property"]
    if "property" in decorators or any(d.endswith(".setter") for d in decorators):
        if not isinstance(real, property):
            return [f"{where}: a property in the stub, a {type(real).__name__} in {lib}"]
        if any(d.endswith(".setter") for d in decorators) and real.fset is None:
            return [f"{where}: the stub has a setter, {lib}'s property has none"]
        return []
    if "staticmethod" in decorators:
        if not isinstance(real, staticmethod):
            return [f"{where}: a staticmethod in the stub, a {type(real).__name__} in {lib}"]
        return _signature_problems(where, real.__func__, node, lib)
    if "classmethod" in decorators:
        if not isinstance(real, classmethod):
            return [f"{where}: a classmethod in the stub, a {type(real).__name__} in {lib}"]
        return _signature_problems(where, real.__func__, node, lib)
    if isinstance(real, (property, staticmethod, classmethod)) or not callable(real):
        return [f"{where}: a method in the stub, a {type(real).__name__} in {lib}"]
    return _signature_problems(where, real, node, lib)


# ------------------------------------------------------------------ comparing a module
def stub_problems(stubs: Path, package: str, live: dict[str, Any], lib: str) -> list[str]:
    """What the stub of ``package`` under ``stubs`` (``stubs/<package>/**.pyi``) says that the installed
    ``package`` does not have (empty: none); ``lib`` names it in the messages, ``live`` holds its objects whose
    attributes are set at construction, by class name."""
    problems = []
    paths = sorted((stubs / package).rglob("*.pyi"))
    assert paths, f"no stub under {stubs}"
    for path in paths:
        name = _module_name(path, stubs)
        module = importlib.import_module(name)
        parent = name if path.name == "__init__.pyi" else name.rpartition(".")[0]
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.level:  # `from .x import y as y`: a re-export (the `as`)
                source = importlib.import_module(
                    importlib.util.resolve_name("." * node.level + (node.module or ""), parent)
                )
                for alias in node.names:
                    if alias.asname is None:
                        continue  # imported for the stub's own annotations only
                    expected = getattr(source, alias.name, None)
                    if expected is None:
                        problems.append(f"{name}: {source.__name__} has no {alias.name}")
                    elif getattr(module, alias.asname, None) is not expected:
                        problems.append(f"{name}.{alias.asname}: not {source.__name__}.{alias.name}")
            elif isinstance(node, ast.AnnAssign):
                assert isinstance(node.target, ast.Name)
                if not hasattr(module, node.target.id):
                    problems.append(f"{name}.{node.target.id}: no such module attribute")
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                real = getattr(module, node.name, None)
                where = f"{name}.{node.name}"
                if real is None:
                    problems.append(f"{where}: no such name")
                elif isinstance(node, ast.ClassDef):
                    problems += _class_problems(where, real, node, live, lib, package)
                else:
                    problems += _signature_problems(where, real, node, lib)
    return problems


def edited_stubs(stubs: Path, package: str, edit: tuple[str, str, str], into: Path) -> Path:
    """A copy of ``stubs/<package>`` under ``into`` with one edit ``(file, old, new)``: ``old``, found exactly
    once in ``<package>/<file>``, replaced by ``new``; returns ``into``, for :func:`stub_problems`."""
    shutil.copytree(stubs / package, into / package)
    file, old, new = edit
    path = into / package / file
    text = path.read_text()
    assert text.count(old) == 1, f"the edit's anchor {old!r} is not once in {file}"
    path.write_text(text.replace(old, new))
    return into
