"""``requires_grad`` changed behind the schedule's back, on 2 gloo ranks, as a user would hit it.

Launched by ``tests/integrations/test_divergence.py``; each rank writes one entry per case:

* ``helper_unfreezes``: PhasedAccelerator, one plain optimizer over every
  parameter with ``groups=``, the phase training a head while the trunk (in
  every forward) is idle; at step 1 a helper calls ``model.requires_grad_(True)``
  before the forward (what ``prepare_model_for_kbit_training`` does). The trunk
  gets local gradients DDP never all-reduced: the step must be refused on every
  rank, before any weight changes.
* ``after_backward``: the same call after the backward (no gradient reached the
  idle group yet): the flags are put back with a warning and the run goes on,
  ranks bit-identical after 10 steps.
* ``advice_followed``: the loop runs the head the schedule does not train and
  unfreezes it (the wrong adapter / task), with ``find_unused_parameters=True``
  (the advice the old message gave): still refused, never silent.
* ``trainer_callback``: the same helper call from a user callback under the
  Trainer with ``AlternatingFreeze``: refused before the Trainer's optimizer step.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState
from torch import nn

from hf_altparams.engine.shutdown import shutdown
from hf_altparams.errors import AltParamsError
from hf_altparams.integrations.accelerate import PhasedAccelerator
from hf_altparams.plan import Alternating, ParamGroups
from hf_altparams.testing import write_rank_result

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tests.scripts, tests.support: however the script is started
    sys.path.insert(0, str(REPO))

from tests.support.digests import param_sha  # noqa: E402


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 1), nn.Linear(6, 1)

    def forward(self, x: torch.Tensor, head: str = "a") -> torch.Tensor:
        return getattr(self, head)(torch.tanh(self.trunk(x)))


def batch(step: int) -> torch.Tensor:  # different data on each rank: without an all-reduce the ranks drift
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))


def accelerate_case(when: str, find_unused: bool = False) -> dict[str, Any]:
    AcceleratorState._reset_state()
    model = TwoHeads()
    # the helper's case: the phase trains head "a" alone, the trunk (in every forward) is idle; the
    # advice case: the phase trains trunk + "a", and the loop runs head "b" instead
    specs = (
        {"trunk_a": ["trunk.*", "a.*"], "b": "b.*"}
        if when == "advice"
        else {"a": "a.*", "trunk": "trunk.*", "b": "b.*"}
    )
    groups = ParamGroups(model, specs)
    acc = PhasedAccelerator(
        Alternating({list(specs)[0]: 20, "b": 1}), groups=groups, cpu=True, find_unused_parameters=find_unused
    )
    prepared, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    error, seen = None, []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(10):
            head = "b" if when == "advice" and step == 1 else "a"
            if step == 1 and when in ("before_forward", "advice"):
                model.requires_grad_(True)  # e.g. prepare_model_for_kbit_training / set_adapter
            before = param_sha(model)
            acc.backward(prepared(batch(step), head).pow(2).mean())
            if step == 1 and when == "after_backward":
                model.requires_grad_(True)
            try:
                opt.step()
            except AltParamsError as err:
                error = str(err)
                seen.append(param_sha(model) == before)  # nothing applied
                break
            opt.zero_grad()
        seen_warnings = [str(w.message) for w in caught if "hf_altparams" in str(w.message)]
    result = {
        "error": error,
        "unchanged": seen,
        "digest": param_sha(model),
        "warnings": seen_warnings,
        "steps": acc.schedule_step,
    }
    shutdown(prepared, destroy=False)  # the wrapper's reducer freed before the next case's
    acc.free_memory()
    return result


def trainer_case(out: str) -> dict[str, Any]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_altparams.integrations.trainer import AlternatingFreeze

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": torch.randn(6, generator=torch.Generator().manual_seed(i)), "labels": torch.zeros(1)}

    class Model(TwoHeads):
        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
            return {"loss": (super().forward(x) - labels).pow(2).mean()}

    class Helper(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            if state.global_step == 1:
                model.requires_grad_(True)

    AcceleratorState._reset_state(reset_partial_state=True)
    args = TrainingArguments(
        output_dir=out,
        max_steps=4,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        ddp_find_unused_parameters=False,
    )
    freeze = AlternatingFreeze({"a": "a.*", "trunk": "trunk.*", "b": "b.*"}, Alternating({"a": 20, "trunk": 1}))
    trainer = Trainer(model=Model(), args=args, train_dataset=Data(), callbacks=[freeze, Helper()])
    try:
        trainer.train()
    except AltParamsError as err:
        return {"error": str(err)}
    return {"error": None}


def main() -> None:
    out = sys.argv[1]
    results = {
        "helper_unfreezes": accelerate_case("before_forward"),
        "after_backward": accelerate_case("after_backward"),
        "advice_followed": accelerate_case("advice", find_unused=True),
        "trainer_callback": trainer_case(out),
    }
    write_rank_result(out, results)
    shutdown()  # gloo's threads finish, then the process group ends (no abort at interpreter exit)


if __name__ == "__main__":
    main()
