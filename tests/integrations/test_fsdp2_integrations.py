"""PhasedAccelerator with FSDP2: Accelerate's own FSDP2 path on 2 gloo CPU ranks, refusals, GPU run.

On CPU Accelerate would pick MULTI_CPU and ignore the FSDP plugin, so the check
script sets the distributed type to FSDP after construction
(``hf_altparams.testing.fsdp2.use_accelerate_fsdp2``): ``prepare`` then runs
Accelerate's ``fsdp2_prepare_model`` (``fully_shard`` on CPU) and
``save_state`` / ``load_state`` its DCP sharded checkpoints. On a GPU the same
script runs Accelerate's FSDP2 for real (the ``cuda`` test, ``benchmarks/gpu.sh``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from torch import nn

from hf_altparams.errors import AltParamsError
from hf_altparams.plan import Alternating
from hf_altparams.testing import launch, rank_results, script_path


def _check(results: list[dict[str, Any]]) -> None:
    rank0 = results[0]
    assert rank0["sharded_units"] >= 4  # one unit per Linear and the root
    for r in results:
        # same parameters as one process running the schedule on the concatenated batch
        assert r["max_diff"] < 1e-5, r["max_diff"]
        # bytes each rank fed to reduce-scatter per step == the phase's trainable (padded) bytes
        assert r["counted"] == r["expected"]
        assert len(set(r["expected"])) == 3  # three phases, three different amounts
        assert r["reduce_scatter_first"] >= r["trainable_bytes_first"] > 0  # in the switch log
        # a run resumed from Accelerate's sharded (DCP) checkpoint mid-run ends bitwise equal
        assert (r["loaded_step"], r["loaded_phase"]) == (3, "c")
        assert r["resume_bitwise_equal"], r["resume_max_diff"]
        assert {"optimizer_0", "pytorch_model_fsdp_0", "hf_altparams_state.json"} <= set(r["ckpt_files"])


@pytest.mark.distributed
def test_accelerate_fsdp2_matches_reference_counts_bytes_and_resumes_exactly(tmp_out: Path) -> None:
    launch(script_path("accelerate_fsdp2_check.py"), str(tmp_out), nproc=2, launcher="torchrun",
           env={"ACCELERATE_USE_CPU": "1"})
    results = rank_results(tmp_out, nproc=2)
    assert all(r["forced_fsdp2_on_cpu"] for r in results)
    _check(results)


@pytest.mark.cuda
def test_accelerate_fsdp2_on_a_gpu_for_real(tmp_out: Path) -> None:
    launch(script_path("accelerate_fsdp2_check.py"), str(tmp_out), nproc=1, launcher="torchrun",
           env={"CUDA_VISIBLE_DEVICES": "0"})
    results = rank_results(tmp_out, nproc=1)
    assert not results[0]["forced_fsdp2_on_cpu"] and results[0]["device"].startswith("cuda")
    _check(results)


@pytest.fixture
def fresh_accelerate_state() -> Iterator[None]:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_fsdp1_plugin_is_refused_naming_fsdp2() -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin

    from hf_altparams.integrations.accelerate import PhasedAccelerator

    with pytest.raises(AltParamsError, match=r"FullyShardedDataParallelPlugin\(fsdp_version=2"):
        PhasedAccelerator(Alternating(["a", "b"]), cpu=True,
                          fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1))


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_deepspeed_is_refused_at_prepare_naming_fsdp2_and_ddp() -> None:
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    from hf_altparams.engine import GroupedOptimizer
    from hf_altparams.integrations.accelerate import PhasedAccelerator
    from hf_altparams.plan import ParamGroups

    acc = PhasedAccelerator(Alternating(["a", "b"]), cpu=True)
    AcceleratorState().distributed_type = DistributedType.DEEPSPEED  # as `accelerate launch` with a DS config
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = GroupedOptimizer(ParamGroups(model, {"a": "0.*", "b": "2.*"}), lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(AltParamsError, match=r"DeepSpeed.*fsdp_version=2.*--multi_gpu") as info:
        acc.prepare(model, opt)
    assert "'DEEPSPEED'" in str(info.value)
    assert all(p.requires_grad for p in model.parameters())  # refused before any phase was applied
