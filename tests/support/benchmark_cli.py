"""A benchmark's command line run in the test's own process, as ``python benchmarks/<name>.py ARGS`` would run it.

The benchmark drivers only plan, launch and summarise; their ranks run in
processes of their own (``--launcher forked`` forks them from the warm server
of :mod:`hf_altparams.testing`, which lives as long as the test process). A
test that calls the driver's ``main`` here saves the interpreter start-up of
a driver process (torch and transformers imported again) and lets every
launch of the test process share one warm server.

``benchmarks/`` is not a package: its scripts import their neighbours
(``_machine``, ``_breakdown``) as top-level modules, as a script's folder is on
``sys.path``. :func:`benchmark_main` puts that folder on ``sys.path`` while the
module loads and while ``main`` runs, and puts ``sys.path`` back afterwards.

Example::

    from tests.support.benchmark_cli import benchmark_main

    benchmark_main("alternating", "--devices", "cpu", "--launcher", "forked", "--out", str(tmp_path))
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@contextlib.contextmanager
def _benchmarks_on_path() -> Iterator[None]:
    saved = list(sys.path)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield
    finally:
        sys.path[:] = saved


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as the module ``benchmarks_<name>`` (loaded once per process)."""
    key = f"benchmarks_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None, name
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # a dataclass of the module looks the module up there
        with _benchmarks_on_path():
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[key]
                raise
    return sys.modules[key]


def benchmark_main(name: str, *argv: str) -> Any:
    """Call ``benchmarks/<name>.py``'s ``main(argv)`` here and return what it returns.

    A refused argument raises ``SystemExit(2)`` (argparse's message on stderr),
    as the script would exit.
    """
    module = load_benchmark(name)
    with _benchmarks_on_path():
        return module.main(list(argv))
