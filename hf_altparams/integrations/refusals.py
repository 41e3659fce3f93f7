"""Every configuration hf_altparams refuses, in one table: what it is, why, and the way out.

Both integrations ask this module before anything changes
(``PhasedAccelerator(...)`` and its ``prepare``; ``AlternatingFreeze`` at
``on_init_end`` and ``on_train_begin``). What is specific to an integration is
only how it *recognises* its run: each builds a :class:`Configuration` from what
it sees (Accelerate's distributed type, plugins and process count; the
Trainer's arguments and Accelerate's shared state), and :func:`check` raises
the first row of :data:`REFUSALS` that applies, naming the integration, the
setting, the reason and the way out in that integration's terms, with its cause
(``err.cause``: :data:`~hf_altparams.errors.Cause.STRATEGY_REFUSED` for a
strategy or parallelism the phases cannot drive;
:data:`~hf_altparams.errors.Cause.SETUP_REFUSED` for a set-up that would train
each rank alone: Accelerate's one process in a multi-rank job, the Trainer's
unwrapped model).

The table (:data:`REFUSALS`):

============================  ====================================================================
``deepspeed``                 DeepSpeed at a ZeRO stage no registered strategy drives
                              (:mod:`hf_altparams.engine.strategies`: ``zero1``, ``zero2``).
``deepspeed-no-zero``         DeepSpeed without ZeRO (stage 0): nothing partitioned, its own wrappers.
``deepspeed-zero3``           ZeRO-3: the forward gathers every weight and a gradient buffer covers
                              every parameter (measured; the planner still prices it).
``deepspeed-offload``         DeepSpeed's optimizer or parameter offload (another step path).
``deepspeed-bf16-optimizer``  ZeRO-1 + bf16 + fp32 gradient accumulation (DeepSpeed's BF16_Optimizer).
``deepspeed-optimizer-        a DeepSpeed ``optimizer`` section: one param group over every
section``                     parameter, which no phase can split.
``deepspeed-other-paths``     ZenFlow, DeepCompile, pipeline parallelism, universal checkpoints.
``fsdp1``                     FSDP1 reduces whole flat parameters (zeros for frozen parts).
``megatron``                  Megatron-LM builds its own optimizer and reducer.
``xla``                       XLA reduces gradients itself.
``tensor-parallel``           tensor / context parallelism shards parameters outside the strategies.
``compiled``                  a whole-model compiled graph (``dynamo_backend`` without
                              ``use_regional_compilation``; the Trainer's ``torch_compile`` with
                              several ranks): it guards on ``requires_grad`` and the bucket layout,
                              which every switch changes. Compiled regions (:mod:`.regions`) are
                              accepted under DDP and in one process.
``compiled-model``            a model compiled before ``prepare``, in several processes: the same.
``one-process-of-many``       Accelerate chose one process inside a multi-rank job.
``unwrapped-of-many``         the Trainer trains the model without a wrapper in several processes.
============================  ====================================================================

Beside the table, :func:`capability_refusal` refuses a feature the run's
strategy does not declare (:class:`~hf_altparams.engine.strategies.Capabilities`):
the frozen-prefix cache, comm counting, per-task residency.

Example:
    >>> check(Configuration("PhasedAccelerator", fsdp_version=2))  # FSDP2: driven
    >>> refusal_for(Configuration("PhasedAccelerator", fsdp_version=1)).name
    'fsdp1'
    >>> message(Configuration("AlternatingFreeze", world_size=2, compiled="torch_compile=True"))[:90]
    'AlternatingFreeze drives FSDP2, DDP, DeepSpeed ZeRO-1, DeepSpeed ZeRO-2 and one process; i'
    >>> refusal_for(Configuration("AlternatingFreeze", deepspeed=True, deepspeed_config={"zero_optimization": {
    ...     "stage": 3}})).name
    'deepspeed-zero3'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from ..engine.strategies import Strategy, is_registered, registered, strategy_named
from ..errors import AltParamsError, Cause, SwitchError

__all__ = [
    "ACCELERATE",
    "REFUSALS",
    "TRAINER",
    "Configuration",
    "RefusalRule",
    "capability_refusal",
    "check",
    "message",
    "refusal_for",
]

#: The integrations' names, as messages give them.
ACCELERATE = "PhasedAccelerator"
TRAINER = "AlternatingFreeze"


@dataclass(frozen=True)
class Configuration:
    """A run as an integration recognised it: what the table's rows test.

    Attributes:
        integration: :data:`ACCELERATE` or :data:`TRAINER` (how messages name the caller, and which way out).
        deepspeed: DeepSpeed was asked for (a plugin, a config, ``distributed_type`` DEEPSPEED, the env).
        fsdp_version: the FSDP version asked for (``None``: no FSDP).
        megatron: Megatron-LM.
        xla: XLA (TPU).
        tensor_parallel: tensor or context parallelism.
        compiled: how a whole-model compile was asked for (``"dynamo_backend='EAGER'"``), else ``None``;
            the integration says whether it applies (the Trainer's only with several ranks).
        compiled_model: which argument is the grouped model compiled with ``torch.compile`` before the
            integration wraps it, in a run of several processes (else ``None``).
        world_size: ranks of the ``torch.distributed`` job (1 without one).
        processes: processes the framework runs (Accelerate's ``num_processes``).
        unwrapped: the model trains without a wrapper (the Trainer's first training forward).
        distributed_type: the framework's distributed type, for messages (``"NO"``, ``"MULTI_CPU"``, ...).
        deepspeed_config: DeepSpeed's configuration as the framework resolved it (its ``zero_optimization``,
            ``bf16``, ``data_types``, ``optimizer`` ... sections), when DeepSpeed was asked for.
    """

    integration: str
    deepspeed: bool = False
    fsdp_version: Optional[int] = None
    megatron: bool = False
    xla: bool = False
    tensor_parallel: bool = False
    compiled: Optional[str] = None
    compiled_model: Optional[str] = None
    world_size: int = 1
    processes: int = 1
    unwrapped: bool = False
    distributed_type: str = "NO"
    deepspeed_config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def zero_stage(self) -> int:
        """DeepSpeed's ZeRO stage (``zero_optimization.stage``; 0 when absent, as DeepSpeed reads it)."""
        stage = _section(self.deepspeed_config, "zero_optimization").get("stage", 0)
        return int(stage) if isinstance(stage, int) or str(stage).isdigit() else -1

    @property
    def strategy_name(self) -> Optional[str]:
        """The strategy this configuration asks for, when it names one (``None``: decided by the wrapper)."""
        if self.deepspeed:
            return f"zero{self.zero_stage}"
        if self.fsdp_version is not None:
            return "fsdp2" if int(self.fsdp_version) == 2 else "fsdp1"
        return None


@dataclass(frozen=True)
class RefusalRule:
    """One row of the table: when it applies, what to call the setting, why, and the way out per integration."""

    name: str
    applies: Callable[[Configuration], bool]
    what: Callable[[Configuration], str]
    reason: str
    way_out: Mapping[str, str] = field(default_factory=dict)
    #: the exception raised: SwitchError where the refusal comes at a switch or the first forward
    error_type: type[AltParamsError] = AltParamsError
    #: the cause the error carries (``err.cause``)
    cause: Cause = Cause.STRATEGY_REFUSED

    def message(self, config: Configuration) -> str:
        """The refusal as the integration raises it."""
        way_out = self.way_out.get(config.integration, "")
        return f"{config.integration} drives {_supported()}; it cannot drive {self.what(config)}: {self.reason}" + (
            f". {way_out}" if way_out else ""
        )

    def error(self, config: Configuration) -> AltParamsError:
        """The exception raised for ``config``."""
        return self.error_type(self.message(config), cause=self.cause)


def _section(config: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = config.get(name)
    return value if isinstance(value, Mapping) else {}


def _stage(c: Configuration) -> str:
    return f"ZeRO-{c.zero_stage}" if c.zero_stage >= 0 else "ZeRO stage unknown"


def _offloads(c: Configuration) -> list[str]:
    zero = _section(c.deepspeed_config, "zero_optimization")
    found = []
    for key in ("offload_optimizer", "offload_param"):
        device = _section(zero, key).get("device", "none")
        if device not in (None, "none"):
            found.append(f"DeepSpeed's `{key}` (device {device!r})")
    return found


def _bf16_fp32_accumulation(c: Configuration) -> bool:
    bf16 = _section(c.deepspeed_config, "bf16").get("enabled", False)
    accumulation = _section(c.deepspeed_config, "data_types").get("grad_accum_dtype")
    return bool(bf16) and bf16 != "auto" and str(accumulation).lower() in ("fp32", "float32", "torch.float32")


def _other_paths(c: Configuration) -> list[str]:
    config, found = c.deepspeed_config, []
    if _section(config, "zero_optimization").get("zenflow"):
        found.append("DeepSpeed ZenFlow (`zero_optimization.zenflow`)")
    if _section(config, "compile").get("deepcompile"):
        found.append("DeepCompile (`compile.deepcompile`)")
    if _section(config, "pipeline") or config.get("pipeline_parallel_size", 1) not in (1, None, "auto"):
        found.append("pipeline parallelism")
    if _section(config, "checkpoint").get("load_universal"):
        found.append("universal checkpoints (`checkpoint.load_universal`)")
    return found


def _supported() -> str:
    labels = [s.label for s in registered() if s.capabilities.trains]
    return labels[0] if len(labels) == 1 else f"{', '.join(labels[:-1])} and {labels[-1]}"


_FSDP2_OR_DDP = {
    ACCELERATE: (
        "Use FSDP2: `FullyShardedDataParallelPlugin(fsdp_version=2, ...)`, or plain DDP (`accelerate "
        "launch --multi_gpu`)"
    ),
    TRAINER: (
        "Use FSDP2: `fsdp='full_shard'` with `fsdp_config={'fsdp_version': 2}` (in an Accelerate config: "
        "`FullyShardedDataParallelPlugin(fsdp_version=2, ...)`), or plain DDP (launch with `torchrun` or "
        "`accelerate launch --multi_gpu`)"
    ),
}

#: The refused configurations, in the order they are tested.
REFUSALS: tuple[RefusalRule, ...] = (
    RefusalRule(
        "deepspeed",
        lambda c: c.deepspeed and c.zero_stage != 0 and not is_registered(c.strategy_name or ""),
        lambda c: f"DeepSpeed ({_stage(c)})",
        "DeepSpeed fixes the trainable set, its gradient partitions and optimizer state at `deepspeed.initialize`, "
        "and no registered strategy drives its phases at this stage (`zero_optimization.stage` 1 or 2 are)",
        {
            ACCELERATE: (
                "Shard with FSDP2 instead: `FullyShardedDataParallelPlugin(fsdp_version=2, ...)`, or train "
                "with plain DDP (`accelerate launch --multi_gpu`)"
            ),
            TRAINER: (
                "Train with plain DDP instead: drop `deepspeed=` from TrainingArguments (and any DeepSpeed "
                "accelerate config) and launch with `torchrun` or `accelerate launch --multi_gpu`; "
                "AlternatingFreeze then all-reduces only the phase's parameters, and "
                "`grouped_optimizer(..., state_policy='offload')` keeps idle groups' optimizer state on the CPU. "
                "To shard the model, use FSDP2: `fsdp='full_shard'` with `fsdp_config={'fsdp_version': 2}`"
            ),
        },
    ),
    RefusalRule(
        "deepspeed-no-zero",
        lambda c: c.deepspeed and c.zero_stage == 0,
        lambda c: "DeepSpeed without ZeRO (`zero_optimization.stage` 0 or absent)",
        "its engine steps the optimizer through DeepSpeed's own fp16/bf16 wrappers, which skip nothing for idle "
        "groups, and partitions nothing: it gains nothing over DDP",
        {
            ACCELERATE: "Set `zero_stage=1` or `2` in the DeepSpeedPlugin (or `zero_optimization.stage`), or train with "
            "plain DDP (`accelerate launch --multi_gpu`)",
            TRAINER: "Set `zero_optimization.stage` to 1 or 2 in the DeepSpeed config, or drop `deepspeed=` and train "
            "with plain DDP",
        },
    ),
    RefusalRule(
        "deepspeed-zero3",
        lambda c: c.deepspeed and c.zero_stage == 3 and not strategy_named("zero3").capabilities.trains,
        lambda c: "DeepSpeed ZeRO-3 (`zero_optimization.stage=3`)",
        "ZeRO-3 all-gathers every weight for the forward whether its group trains or not, and keeps a gradient "
        "partition buffer for every parameter for the whole run (measured: 34 of 45 MiB gathered per step and "
        "12 MiB of idle groups' gradient buffers per rank on an 8.9M-parameter Llama with LISA, where ZeRO-2 moves "
        "and holds only the phase's): the idle groups' bytes and memory do not go away",
        {
            ACCELERATE: (
                "Use ZeRO-2 (`DeepSpeedPlugin(zero_stage=2)`): it shards gradients, optimizer state and fp32 "
                "masters and moves only the phase's bytes; to shard the parameters too, use FSDP2: "
                "`FullyShardedDataParallelPlugin(fsdp_version=2, ...)`"
            ),
            TRAINER: (
                "Use ZeRO-2 (`zero_optimization.stage=2`): it shards gradients, optimizer state and fp32 masters "
                "and moves only the phase's bytes; to shard the parameters too, use FSDP2: `fsdp='full_shard'` "
                "with `fsdp_config={'fsdp_version': 2}`"
            ),
        },
    ),
    RefusalRule(
        "deepspeed-offload",
        lambda c: c.deepspeed and bool(_offloads(c)),
        lambda c: " and ".join(_offloads(c)),
        "the offloaded optimizer steps DeepSpeed's CPU partitions through another path (its own buffers and "
        "gradient copies), which the phases have not been measured on",
        {
            ACCELERATE: "Leave offload out (`offload_optimizer_device='none'`, `offload_param_device='none'`); "
            "hf_altparams drops idle groups' optimizer state and fp32 partitions itself (`idle_state='drop'`)",
            TRAINER: "Leave `offload_optimizer` / `offload_param` out of the DeepSpeed config; hf_altparams drops idle "
            "groups' optimizer state and fp32 partitions itself (`idle_state='drop'`, lisa's and badam's "
            "default)",
        },
    ),
    RefusalRule(
        "deepspeed-bf16-optimizer",
        lambda c: c.deepspeed and c.zero_stage == 1 and _bf16_fp32_accumulation(c),
        lambda c: "DeepSpeed ZeRO-1 with bf16 and `data_types.grad_accum_dtype='fp32'`",
        "DeepSpeed then trains with its BF16_Optimizer, another class with its own flat groups, not measured with "
        "phases",
        {
            ACCELERATE: "Drop `grad_accum_dtype` (DeepSpeed then accumulates in bf16) or use ZeRO-2",
            TRAINER: "Drop `data_types.grad_accum_dtype` from the DeepSpeed config or use ZeRO-2",
        },
    ),
    RefusalRule(
        "deepspeed-optimizer-section",
        lambda c: c.deepspeed and "optimizer" in c.deepspeed_config,
        lambda c: "a DeepSpeed config with an `optimizer` section",
        "DeepSpeed then builds its optimizer over one param group of every parameter, so a rank's partition mixes "
        "the groups and an idle group can be neither skipped nor freed",
        {
            ACCELERATE: "Remove the `optimizer` section and pass a torch optimizer (e.g. `torch.optim.AdamW(model."
            "parameters(), ...)`) to `prepare` with the model: PhasedAccelerator splits it per group",
            TRAINER: "Remove the `optimizer` section: the Trainer's own `optim`, `learning_rate`, `weight_decay` and "
            "`adam_*` arguments build the same AdamW, which AlternatingFreeze has built per group",
        },
    ),
    RefusalRule(
        "deepspeed-other-paths",
        lambda c: c.deepspeed and bool(_other_paths(c)),
        lambda c: " and ".join(_other_paths(c)),
        "these take other code paths through DeepSpeed's optimizer, not measured with phases",
        {
            ACCELERATE: "Turn them off (ZeRO-1/2 as DeepSpeed runs it by default)",
            TRAINER: "Turn them off in the DeepSpeed config (ZeRO-1/2 as DeepSpeed runs it by default)",
        },
    ),
    RefusalRule(
        "fsdp1",
        lambda c: c.fsdp_version is not None and int(c.fsdp_version) != 2,
        lambda c: f"FSDP version {c.fsdp_version}",
        "FSDP1 keeps whole flat parameters and reduce-scatters them in full (zeros for frozen parts), so freezing "
        "a group saves no communication",
        _FSDP2_OR_DDP,
    ),
    RefusalRule(
        "megatron",
        lambda c: c.megatron,
        lambda c: f"distributed_type={c.distributed_type!r}",
        "Megatron-LM builds its own optimizer and reducer",
        _FSDP2_OR_DDP,
    ),
    RefusalRule(
        "xla",
        lambda c: c.xla,
        lambda c: f"distributed_type={c.distributed_type!r}",
        "XLA reduces gradients itself, without a DDP reducer",
        _FSDP2_OR_DDP,
    ),
    RefusalRule(
        "tensor-parallel",
        lambda c: c.tensor_parallel,
        lambda c: "tensor/context parallelism",
        "it shards parameters outside DDP and FSDP2",
        _FSDP2_OR_DDP,
    ),
    RefusalRule(
        "compiled",
        lambda c: c.compiled is not None,
        lambda c: f"{c.compiled} (torch.compile)",
        "a compiled graph guards on `requires_grad`, which every phase switch changes: a graph over the whole "
        "model is recompiled at each switch (until dynamo gives up) and, under DDP, also guards on the "
        "gradient-bucket layout the switch rebuilds; compiled regions are verified under DDP and in one process",
        {
            ACCELERATE: (
                "Compile by regions instead: `TorchDynamoPlugin(backend=..., use_regional_compilation=True)` "
                "(each repeated block compiled on its own, DDP outside them; under DDP or in one process), "
                "or drop `dynamo_backend`"
            ),
            TRAINER: (
                "Set `torch_compile=False` and compile by regions instead: "
                "`hf_altparams.compile_regions_in_place(model, backend=...)` before building the Trainer (each "
                "repeated block compiled on its own, in place; a single-process run may compile whole)"
            ),
        },
    ),
    RefusalRule(
        "compiled-model",
        lambda c: c.compiled_model is not None,
        lambda c: (
            f"{c.compiled_model}, the grouped model compiled with `torch.compile` before `prepare`, in several "
            "processes"
        ),
        "a compiled graph guards on `requires_grad`, which every phase switch changes (a recompile per switch "
        "until dynamo gives up), and under DDP on the bucket layout the switch rebuilds",
        {
            ACCELERATE: (
                "Pass the uncompiled model to `prepare` and compile by regions: "
                "`TorchDynamoPlugin(backend=..., use_regional_compilation=True)`, or "
                "`hf_altparams.compile_regions_in_place(model)` before `prepare` (in one process, a compiled "
                "model trains, its groups named either way)"
            )
        },
    ),
    RefusalRule(
        # DeepSpeed's engine synchronises over the torch.distributed world whatever Accelerate's process count
        # (on CPU Accelerate gives every rank of a DeepSpeed run a one-process state: its loaders are not sharded)
        "one-process-of-many",
        lambda c: c.processes == 1 and c.world_size > 1 and not c.deepspeed,
        lambda c: (
            f"distributed_type={c.distributed_type!r}: Accelerate chose one process although this is one of "
            f"{c.world_size} ranks of torch.distributed"
        ),
        "each rank would train alone, no gradient all-reduced",
        {
            ACCELERATE: (
                "On CPU ranks Accelerate needs to be told: set ACCELERATE_USE_CPU=1 for `torchrun`, or use "
                "`accelerate launch --multi_gpu --num_processes N` with ACCELERATE_USE_CPU=1 (`accelerate "
                "launch --cpu` runs one process)"
            )
        },
        cause=Cause.SETUP_REFUSED,
    ),
    RefusalRule(
        "unwrapped-of-many",
        lambda c: c.unwrapped and c.world_size > 1,
        lambda c: (
            f"the model as the Trainer left it: it trains in {c.world_size} processes, but the Trainer did "
            "not wrap it in DistributedDataParallel"
        ),
        "no gradient would be synchronised",
        {
            TRAINER: (
                "A known cause: `trainer.evaluate()` or `trainer.predict()` ran before the first "
                "`trainer.train()` (Accelerate then marks the bare model as prepared and `train()` skips the "
                "DDP wrapper; transformers 5.23, accelerate 1.15). Evaluate before training outside the Trainer, "
                "or only after `train()`. Otherwise: use the Trainer's default DDP for multi-process runs"
            )
        },
        SwitchError,
        Cause.SETUP_REFUSED,
    ),
)


def refusal_for(config: Configuration) -> Optional[RefusalRule]:
    """The first row of :data:`REFUSALS` that applies to ``config``, or ``None`` (the run can be driven)."""
    return next((row for row in REFUSALS if row.applies(config)), None)


def message(config: Configuration) -> Optional[str]:
    """The refusal message for ``config``, or ``None``."""
    row = refusal_for(config)
    return None if row is None else row.message(config)


def check(config: Configuration) -> None:
    """Raise the refusal for ``config`` (an :class:`~hf_altparams.errors.AltParamsError`), if a row applies."""
    row = refusal_for(config)
    if row is not None:
        raise row.error(config)


def capability_refusal(
    strategy: Strategy, *, frozen_prefix: bool = False, count_comm: bool = False, per_task_residency: bool = False
) -> Optional[str]:
    """Why a feature the run asks for is refused with ``strategy`` (its capabilities lack it), or ``None``.

    ``per_task_residency``: some phase keeps only some groups resident and
    non-resident groups are to leave the device (``offload_device`` set).

    Example:
        >>> from hf_altparams.engine.strategies import strategy_named
        >>> capability_refusal(strategy_named("fsdp2"), frozen_prefix=True)
        '`frozen_prefix` is not supported with FSDP2 (not verified); leave it out'
        >>> capability_refusal(strategy_named("ddp"), frozen_prefix=True, count_comm=True) is None
        True
    """
    caps = strategy.capabilities
    if frozen_prefix and not caps.frozen_prefix:
        return f"`frozen_prefix` is not supported with {strategy.label} (not verified); leave it out"
    if count_comm and caps.synchronises_gradients and not caps.counts_comm:
        return f"`count_comm=True` is not supported with {strategy.label} (no comm counter); leave it out"
    if per_task_residency and not caps.per_task_residency:
        return (
            f"a schedule whose phases keep only some groups resident, with their groups off the device "
            f"(`offload_device`), is not supported with {strategy.label}; pass `offload_device=None` in the "
            "switcher options, or train with DDP"
        )
    return None
