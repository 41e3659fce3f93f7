"""What a schedule will cost, before spending GPU hours on it.

:func:`plan_cost` needs only the shapes and dtypes of the parameters, so it
works on a model built on the ``meta`` device (no memory at all). Per phase it
reports the trainable parameters, the bytes DDP all-reduces per optimizer step
(exactly the trainable gradients' bytes, what the reducer's buckets hold) and
an estimate of device memory per rank, at the phase's peak (just after an
optimizer step, gradients still set), next to training everything:

* parameters and buffers: all of them, except those of groups the phase does
  not keep resident (``Phase.resident``, e.g. the other tasks of
  ``PerTaskCycle``), which the engine moves to the host with their optimizer
  state (a module's buffers go with its own parameters);
* gradients: the trainable parameters', in the gradient dtype;
* optimizer state on the device, by state policy: ``keep``: every resident group
  that has trained so far (torch creates state at a group's first step);
  ``offload`` / ``drop``: the trainable groups only (the others' is on the host / gone);
* DDP buckets: the trainable gradients' bytes once more, or nothing extra with
  ``gradient_as_bucket_view=True`` (gradients are then views into the buckets).

A switch moves host<->device the state of groups going idle or coming back
(``offload``) and the parameters, buffers and state of groups leaving or
regaining residency; its time is estimated at a stated bandwidth.

It also reports what share of the parameters each phase trains and what trains in
every phase (``CostPlan.trained``, a :class:`~hf_altparams.plan.TrainShare`), with the
warning a run would give when a schedule's ``always`` groups hold most of the model.

Not counted: activations, temporaries of the forward, backward and optimizer
step, Adam's 0-d ``step`` counters (4 B per tensor, on the host unless the
optimizer is fused or capturable), and allocator rounding.

``python -m hf_altparams plan`` (or ``python -m hf_altparams.planner``; :func:`main`)
builds the model on ``meta`` from a transformers config JSON, a checkpoint folder,
or ``pkg.module:factory``.

A plan that computes in bf16 (``storage_dtype=torch.bfloat16``) also says whether
the device the run computes on does bf16 arithmetic fast
(:func:`~hf_altparams.planner.hardware.bf16_speed`): most CPUs without AVX-512
bf16 or AMX run a bf16 matmul about 100x slower than an fp32 one, and the table
warns there, naming the figures and the way out (fp32 weights).

The arithmetic is the engine's memory model (:mod:`hf_altparams.engine.memory.model`),
which :func:`~hf_altparams.engine.memory_report` runs on the live model: on the
same model and run its expected peak equals the planner's figure to the byte.
The package's modules, one concept each: :mod:`~hf_altparams.planner.cost`
(:func:`plan_cost`: the planner's arguments, the groups' sizes, the walk over
phases and switches, the FSDP2 mode), :mod:`~hf_altparams.planner.report`
(:class:`CostPlan`, its rows and its table), :mod:`~hf_altparams.planner.model`
(:func:`build_model` and the dtype names), :mod:`~hf_altparams.planner.hardware`
(is bf16 fast here?) and :mod:`~hf_altparams.planner.cli` (the command line).
"""

from __future__ import annotations

from .cli import SCHEDULES, build_from_argv, build_parser, main, plan_from_argv
from .cost import DEFAULT_PCIE_GBPS, OPTIMIZER_STATES, POLICIES, OptimizerSpec, plan_cost
from .hardware import Bf16Speed, bf16_speed
from .model import DTYPE_NAMES, build_model
from .report import CostPlan, PhaseCost, SwitchCost

__all__ = [
    "DEFAULT_PCIE_GBPS",
    "DTYPE_NAMES",
    "OPTIMIZER_STATES",
    "POLICIES",
    "SCHEDULES",
    "Bf16Speed",
    "CostPlan",
    "OptimizerSpec",
    "PhaseCost",
    "SwitchCost",
    "bf16_speed",
    "build_from_argv",
    "build_model",
    "build_parser",
    "main",
    "plan_cost",
    "plan_from_argv",
]
