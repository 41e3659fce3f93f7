"""Low-precision storage: parameters in bf16/fp16, fp32 masters only for the groups that train.

:class:`PrecisionOptimizer` is a :class:`~hf_altparams.engine.GroupedOptimizer`
for a model whose parameters are *stored* in a low-precision dtype (bf16 or
fp16). Forward and backward run in the storage dtype, so gradients are
produced, bucketed and all-reduced by DDP in that dtype: the bytes on the wire
per step are ``trainable parameters x 2``. A group that trains has an fp32
*master* copy of its parameters; ``step()`` hands the inner optimizer the
master (and the gradient cast to fp32), so the optimizer state is created and
updated in fp32, and writes the rounded result back into the stored
parameter. A group that goes idle keeps its master according to
``master_policy``:

* ``"offload"``: the master moves to host memory (pinned from CUDA) and comes
  back when the group trains again. Exact: the run equals one that kept every
  master on the device.
* ``"drop"``: the master is freed and re-created from the stored (rounded)
  weights when the group returns, as BAdam does. Cost: whatever the master
  held below the storage precision is lost at every re-entry; each re-entry
  rounds the group's weights once to bf16 (relative error up to 2**-9) or
  fp16 (2**-12), i.e. updates smaller than half a storage ulp that had
  accumulated in the master during the group's last active stretch are
  forgotten. Saves 4 bytes per idle parameter of host memory.
* ``"keep"``: the master stays where it is (device memory: 4 bytes per
  parameter, idle or not).

Model state per rank at the step is then ``2 x all parameters + (4 master +
4 fp32 gradient + 2 DDP bucket + optimizer state) x active parameters`` (+ the
idle groups' state and masters per policy); ``python -m hf_altparams plan
--storage-dtype bfloat16`` computes it.

The swap is done on ``param.data`` for the duration of the inner step only, so
everything that knows a parameter by identity (DDP, ``state_dict`` names, LR
schedulers, checkpoints) keeps working. Masters are saved in
:meth:`PrecisionOptimizer.state_dict` (``"masters"``), so a resumed run is exact.

fp16 storage needs loss scaling: pass ``loss_scale="dynamic"`` (or a number)
and back-propagate ``optimizer.scale_loss(loss)``. (Accelerate's and the
Trainer's fp16 ``GradScaler`` refuse fp16 gradients; use bf16 storage there.) Gradients are unscaled in fp32;
a step with a non-finite gradient is skipped on every rank (the gradients are
all-reduced first, so every rank sees the same inf/NaN) and the scale halves.

``allreduce_dtype=torch.float32`` all-reduces the bf16 buckets in fp32
(``trainable x 4`` bytes, default ``x 2``) with a comm hook that
:meth:`PrecisionOptimizer.attach_ddp` registers (``PhaseSwitcher.attach``
calls it); the masters get the fp32 sum. Gradient accumulation sums the
micro-steps in fp32 (4 bytes per trainable parameter from the second
micro-step; :class:`Fp32Grads`), ``param.grad`` holding the sum rounded to the
storage dtype; a gradient changed before the step (clipped) is taken as changed.

The pieces, in this module: :func:`store_model` (the model cast to the storage
dtype, once), :func:`masters_in_place` (the masters stand in for their
parameters in the inner optimizers for the duration of a step),
:class:`Fp32Grads` (the fp32 gradients between the backward passes and the
step), :class:`DynamicLossScale` (fp16's loss scale) and
:class:`PrecisionOptimizer`. Idle masters move to the host and back through a
:class:`~hf_altparams.engine.memory.TensorMover`, as optimizer state does.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from ...errors import AltParamsError, PlanError, SwitchError
from ...plan.groups import ParamGroups
from ..collective import is_distributed
from ..comm import CommCounter, register_comm_counter
from ..ddp import comm_hook_states
from ..driver import PhaseSource
from ..memory import StatePolicy, StatePolicyLike
from .grouped import GroupedOptimizer, OptimizerFactory
from .idle import optional_policies

__all__ = ["DynamicLossScale", "Fp32Grads", "MasterPolicy", "PrecisionOptimizer", "masters_in_place", "store_model"]


def store_model(module: nn.Module, dtype: torch.dtype) -> list[str]:
    """Store ``module`` in ``dtype``: cast its floating parameters and their modules' floating buffers in place.

    Every floating-point parameter is cast, in a group or not: a model runs in
    one dtype (an fp32 parameter left among bf16 ones fails in the first matmul
    that mixes them), and the planner counts it so. A module's floating buffers
    follow its own parameters (BatchNorm's running statistics must match its
    weight); buffers of modules without parameters of their own (rotary
    frequencies, fixed masks) keep the dtype the model gave them. Tensors keep
    their identity (only ``.data`` changes). Returns the names of the tensors cast.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.BatchNorm1d(2))
        >>> store_model(net, torch.bfloat16)
        ['0.weight', '1.weight', '1.bias', '1.running_mean', '1.running_var']
    """
    cast: list[str] = []
    for mname, sub in module.named_modules():
        own = [(n, p) for n, p in sub.named_parameters(recurse=False) if p.is_floating_point()]
        if not own:
            continue
        buffers = [(n, b) for n, b in sub.named_buffers(recurse=False) if b is not None and b.is_floating_point()]
        for name, tensor in [*own, *buffers]:
            if tensor.dtype != dtype:
                tensor.data = tensor.data.to(dtype)
                cast.append(f"{mname}.{name}" if mname else name)
    return cast


@contextlib.contextmanager
def masters_in_place(optimizers: Iterable[Optimizer], pairs: list[tuple[nn.Parameter, torch.Tensor]]) -> Iterator[None]:
    """Within the block, each master replaces its parameter in the optimizers' ``param_groups`` and ``state``.

    Python lists and dicts only: the stored parameters are never touched, so
    DDP's autograd hooks on them stay valid.

    Example:
        >>> p = nn.Parameter(torch.ones(2, dtype=torch.bfloat16)); master = p.detach().float()
        >>> opt = torch.optim.SGD([p], lr=1.0); master.grad = torch.ones(2)
        >>> with masters_in_place([opt], [(p, master)]):
        ...     opt.step()
        >>> master, opt.param_groups[0]["params"][0] is p
        (tensor([0., 0.]), True)
    """
    optimizers = list(optimizers)
    master_of = {id(p): m for p, m in pairs}
    param_of = {id(m): p for p, m in pairs}

    def swap(lookup: dict[int, torch.Tensor]) -> None:
        for opt in optimizers:
            for group in opt.param_groups:
                group["params"] = [lookup.get(id(t), t) for t in group["params"]]
            for old in [t for t in opt.state if id(t) in lookup]:
                opt.state[lookup[id(old)]] = opt.state.pop(old)

    swap(master_of)
    try:
        yield
    finally:
        swap(param_of)  # type: ignore[arg-type]


class DynamicLossScale:
    """A loss scale that halves on a non-finite gradient and doubles after ``growth_interval`` clean steps.

    Example:
        >>> s = DynamicLossScale(init_scale=8.0, growth_interval=2)
        >>> s.update(found_inf=True); s.scale
        4.0
        >>> s.update(False); s.update(False); s.scale
        8.0
    """

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000, dynamic: bool = True) -> None:
        if not init_scale > 0:
            raise PlanError(f"`loss_scale` must be positive; got {init_scale!r}")
        self.scale = float(init_scale)
        self.growth_interval = growth_interval
        self.dynamic = dynamic
        self._clean = 0

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step (skipped if ``found_inf``)."""
        if not self.dynamic:
            return
        if found_inf:
            self.scale = max(self.scale / 2.0, 1.0)
            self._clean = 0
        else:
            self._clean += 1
            if self._clean >= self.growth_interval:
                self.scale *= 2.0
                self._clean = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean": self._clean}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._clean = int(state["clean"])


class Fp32Grads:
    """The fp32 gradients of a :class:`PrecisionOptimizer`'s stored parameters.

    It holds, per stored (bf16/fp16) parameter of a group that trains:
    * ``accumulated``: with gradient accumulation, the fp32 sum of the local
      gradients of the window's micro-steps. Before each forward pass with grad
      enabled (a forward pre-hook on the grouped module) the gradient left in
      ``param.grad`` moves into the fp32 sum and ``param.grad`` is released, so the
      next backward starts a fresh storage-dtype gradient; after that backward
      (a post-accumulate-grad hook, which runs before DDP's own hook) the new
      gradient is added to the sum and ``param.grad`` is overwritten with the sum
      rounded to the storage dtype. So ``param.grad`` always holds the whole
      window's gradient, as without this class (what DDP buckets and all-reduces,
      what gradient clipping sees), and the step uses the fp32 sum itself as long as
      ``param.grad`` still equals its rounding. Nothing happens at accumulation 1.
      Cost: 4 bytes per trainable parameter from the second micro-step to the step.
    * ``reduced``: the all-reduced gradient in fp32 when DDP's buckets are
      all-reduced in fp32 (``allreduce_dtype=torch.float32``), delivered by the
      comm hook (:func:`~hf_altparams.engine.comm.counting_allreduce_hook`, which
      also replaces each bucket slice by its fp32 sum before reducing).

    The step takes the fp32 value only while ``param.grad`` still equals its
    rounding: a gradient changed in between (clipped, unscaled) is taken from
    ``param.grad``. In a multi-process run a local fp32 sum that no fp32 all-reduce
    consumed is never used: DDP (or the user) reduced ``param.grad``, which then holds the truth.

    Example:
        >>> net = nn.Linear(2, 1).to(torch.bfloat16)
        >>> grads = Fp32Grads(lambda: list(net.parameters()))
        >>> for _ in range(2):  # two micro-steps
        ...     grads.before_forward()
        ...     net(torch.ones(1, 2, dtype=torch.bfloat16)).sum().backward()
        >>> net.bias.grad, grads.take(net.bias), net.bias.grad
        (tensor([2.], dtype=torch.bfloat16), tensor([2.]), None)
    """

    def __init__(self, params: Callable[[], Sequence[nn.Parameter]]) -> None:
        self._params = params  # the stored parameters of the active groups that have masters
        self.accumulated: dict[int, torch.Tensor] = {}
        self.reduced: dict[int, torch.Tensor] = {}
        self._hooked: set[int] = set()
        self._added: set[int] = set()  # parameters whose gradient of this micro-step is in `accumulated`

    def before_forward(self) -> None:
        """Move each gradient the last micro-step left in ``param.grad`` into its fp32 sum."""
        if not torch.is_grad_enabled():
            return
        self._added.clear()
        with torch.no_grad():
            for param in self._params():
                if id(param) not in self._hooked and param.requires_grad:
                    param.register_post_accumulate_grad_hook(self._after_accumulate)
                    self._hooked.add(id(param))
                grad = param.grad
                if grad is None:
                    continue
                total = self.accumulated.get(id(param))
                if total is None:
                    self.accumulated[id(param)] = grad.float()
                elif not torch.equal(grad, total.to(grad.dtype)):  # changed since: take it as it is now
                    total.copy_(grad)
                param.grad = None

    def _after_accumulate(self, param: torch.Tensor) -> None:
        total, grad = self.accumulated.get(id(param)), param.grad
        if total is None or grad is None:
            return  # the window's first micro-step: param.grad is its whole gradient
        with torch.no_grad():
            if id(param) in self._added:  # a second accumulation in one backward (reentrant checkpointing)
                total.add_(grad.float() - total.to(grad.dtype).float())
            else:
                total.add_(grad)
                self._added.add(id(param))
            grad.copy_(total)  # rounded: the window's gradient, for DDP and anyone reading param.grad

    def bucket_input(
        self, params: Sequence[torch.Tensor], buffer: torch.Tensor, dtype: Optional[torch.dtype]
    ) -> torch.Tensor:
        """What a DDP bucket all-reduces in ``dtype``: its gradients, the fp32 sums where there are some."""
        dtype = dtype or buffer.dtype
        if dtype != torch.float32:
            return buffer if dtype == buffer.dtype else buffer.to(dtype)
        flat = buffer.to(torch.float32, copy=True)
        offset = 0
        for param in params:
            total = self.accumulated.pop(id(param), None)
            if total is not None:
                flat[offset : offset + param.numel()].copy_(total.view(-1))
            offset += param.numel()
        return flat

    def deliver(self, params: Sequence[torch.Tensor], reduced: torch.Tensor) -> None:
        """Keep an fp32 all-reduced bucket's slices as its parameters' gradients for the step."""
        if reduced.dtype != torch.float32:
            return
        managed = {id(p) for p in self._params()}
        offset = 0
        for param in params:
            if id(param) in managed:
                self.reduced[id(param)] = reduced[offset : offset + param.numel()].view(param.shape)
            offset += param.numel()

    def take(self, param: nn.Parameter) -> Optional[torch.Tensor]:
        """``param``'s fp32 gradient for the step (``None`` if it has none); ``param.grad`` is released."""
        grad, param.grad = param.grad, None
        reduced = self.reduced.pop(id(param), None)
        total = self.accumulated.pop(id(param), None)
        if total is not None and is_distributed(None):
            total = None  # a local sum: param.grad was all-reduced, the fp32 sum was not
        exact = reduced if reduced is not None else total
        if grad is None:
            return exact
        if exact is not None and torch.equal(grad, exact.to(grad.dtype)):
            return exact
        return grad.float()

    def pending(self) -> int:
        """Bytes held for gradients not yet consumed by a step."""
        return sum(t.nbytes for t in (*self.accumulated.values(), *self.reduced.values()))

    def clear(self) -> None:
        """Drop every pending fp32 gradient (``zero_grad``)."""
        self.accumulated.clear()
        self.reduced.clear()


#: The hook of each module that feeds a PrecisionOptimizer's fp32 gradients (one per module: a later
#: PrecisionOptimizer on the same model takes it over).
_GRADS32_HOOKS: weakref.WeakKeyDictionary[nn.Module, RemovableHandle] = weakref.WeakKeyDictionary()

#: An idle group's fp32 master follows the same three policies as its optimizer state.
MasterPolicy = StatePolicy
STORAGE_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
PRECISION_FORMAT = "hf_altparams.PrecisionOptimizer/1"


class PrecisionOptimizer(GroupedOptimizer):
    """A :class:`GroupedOptimizer` over low-precision parameters with fp32 masters for active groups.

    Args:
        groups: the parameter groups (of a model stored in ``storage_dtype``).
        optimizers: factory (or one per group), as for :class:`GroupedOptimizer`.
        storage_dtype: ``torch.bfloat16`` or ``torch.float16``: the whole model
            is stored in it (:func:`~hf_altparams.engine.optim.store_model`): every floating-point parameter
            of ``groups.module``, grouped or not, and the floating buffers of the
            modules that own them are cast in place (do this before wrapping the
            model in DDP). ``None``: keep the dtypes the model has.
        master_policy: what an idle group's fp32 master does: ``"offload"``
            (exact), ``"drop"`` (re-created from the stored weights) or
            ``"keep"``; one value or one per group. ``None`` (default): the
            run's (a switcher's ``idle_state``, else ``"drop"`` under
            :func:`~hf_altparams.plan.lisa` and :func:`~hf_altparams.plan.badam`,
            ``"offload"`` otherwise and for an optimizer used on its own).
        state_policy: idle groups' optimizer state, as for :class:`GroupedOptimizer`.
        loss_scale: ``None`` (default; right for bf16), ``"dynamic"`` (for fp16)
            or a fixed number. With a loss scale the loop must back-propagate
            ``optimizer.scale_loss(loss)``; ``step()`` refuses gradients of an
            unscaled loss.
        active: the groups that step at first (default all).
        allreduce_dtype: the dtype DDP all-reduces the gradients in: ``None``
            (default: the storage dtype, 2 bytes per trainable parameter for
            bf16) or ``torch.float32`` (4 bytes; the masters get the fp32 sum).
            Set on the DDP wrapper by :meth:`attach_ddp`.

    Example:
        >>> import functools, torch
        >>> from hf_altparams.plan import ParamGroups
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
        >>> opt = PrecisionOptimizer(groups, functools.partial(torch.optim.AdamW, lr=1e-2),
        ...                          storage_dtype=torch.bfloat16, master_policy="drop", active={"a"})
        >>> net[0].weight.dtype, opt.master_bytes()  # masters appear at a group's first step
        (torch.bfloat16, {})
        >>> net(torch.ones(1, 2, dtype=torch.bfloat16)).sum().backward(); opt.step(); opt.zero_grad()
        >>> opt.master_bytes()
        {'cpu': 24}
        >>> opt.set_active({"b"}); opt.master_bytes()  # "drop": group a's master is gone
        {}
    """

    def __init__(
        self,
        groups: ParamGroups,
        optimizers: Union[OptimizerFactory, Mapping[str, OptimizerFactory]],
        *,
        storage_dtype: Optional[torch.dtype] = torch.bfloat16,
        master_policy: Union[None, StatePolicyLike, Mapping[str, StatePolicyLike]] = None,
        state_policy: Union[None, StatePolicyLike, Mapping[str, StatePolicyLike]] = None,
        loss_scale: Union[None, str, float] = None,
        active: Optional[Iterable[str]] = None,
        allreduce_dtype: Optional[torch.dtype] = None,
    ) -> None:
        if storage_dtype is not None and storage_dtype not in STORAGE_DTYPES:
            raise PlanError(f"`storage_dtype` is {storage_dtype!r}; accepted: {list(STORAGE_DTYPES)} or None")
        if allreduce_dtype is not None and allreduce_dtype not in STORAGE_DTYPES:
            raise PlanError(
                f"`allreduce_dtype` is {allreduce_dtype!r}; accepted: None (the storage dtype) "
                f"or one of {list(STORAGE_DTYPES)}"
            )
        given = optional_policies(master_policy, groups.names, "master_policy")
        if storage_dtype is not None:
            store_model(groups.module, storage_dtype)
        self.loss_scale: Optional[DynamicLossScale] = None
        if loss_scale == "dynamic":
            self.loss_scale = DynamicLossScale()
        elif isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
            self.loss_scale = DynamicLossScale(float(loss_scale), dynamic=False)
        elif loss_scale is not None:
            raise PlanError(f"`loss_scale` is {loss_scale!r}; accepted: None, 'dynamic' or a positive number")
        self._given_master: dict[str, Optional[StatePolicy]] = given
        self._run_master = StatePolicy.OFFLOAD  # for the masters whose policy was left open (follow() sets the run's)
        self.masters: dict[str, dict[str, torch.Tensor]] = {n: {} for n in groups.names}
        self.skipped_steps = 0
        self._loss_scaled = False
        self.allreduce_dtype = allreduce_dtype
        this = weakref.ref(self)  # the module's hook must not keep the optimizer alive

        def stored_active() -> list[nn.Parameter]:
            live = this()
            return live.stored_active() if live is not None else []

        self._grads32 = Fp32Grads(stored_active)
        super().__init__(groups, optimizers, state_policy=state_policy, active=active)
        grads = self._grads32
        # one such hook per module: a later PrecisionOptimizer on the same model takes it over
        previous = _GRADS32_HOOKS.pop(groups.module, None)
        if previous is not None:
            previous.remove()
        _GRADS32_HOOKS[groups.module] = groups.module.register_forward_pre_hook(lambda *_: grads.before_forward())

    def stored_active(self) -> list[nn.Parameter]:
        """The active groups' low-precision parameters (those with fp32 masters)."""
        return [p for n in self.active for p in self.groups.params(n) if self._needs_master(p)]

    def attach_ddp(self, ddp: DistributedDataParallel) -> Optional[CommCounter]:
        """With ``allreduce_dtype``: register the comm hook that all-reduces ``ddp``'s buckets in it.

        ``PhaseSwitcher.attach`` calls it; call it yourself when you wrap the
        model in DDP without a switcher. Returns the hook's byte counter
        (shared with ``register_comm_counter``), or ``None`` without
        ``allreduce_dtype`` (DDP's own all-reduce, in the storage dtype). A
        wrapper with another comm hook (DDP takes one) is refused with
        :class:`SwitchError`.
        """
        if self.allreduce_dtype is None:
            return None
        others = [type(s).__name__ for s in comm_hook_states(ddp) if not isinstance(s, CommCounter)]
        if others:
            raise SwitchError(
                f"PrecisionOptimizer(allreduce_dtype={self.allreduce_dtype}) needs its own DDP "
                f"comm hook, but the wrapper has one already (state {others[0]}); DDP runs "
                "one hook per wrapper: drop the other hook or `allreduce_dtype`"
            )
        return register_comm_counter(ddp, dtype=self.allreduce_dtype, grads=self._grads32)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients, the fp32 accumulated sums included."""
        super().zero_grad(set_to_none=set_to_none)
        self._grads32.clear()

    # ---------------------------------------------------------------- masters
    @staticmethod
    def _needs_master(param: nn.Parameter) -> bool:
        return param.is_floating_point() and param.dtype != torch.float32

    def enter_phase(self, trainable: Iterable[str]) -> None:
        """A phase that trains ``trainable`` starts: its offloaded masters come back to the parameters'
        device, idle groups' masters follow ``master_policy``; then the optimizer-state policy applies."""
        coming = frozenset(n for n in trainable if n in self.inner)
        for name in self.groups.names:
            if name in coming:
                self._materialize(name)
            else:
                self._idle_master(name)
        super().enter_phase(coming)

    def _materialize(self, name: str) -> None:
        """Bring group ``name``'s offloaded masters back; missing ones are created at its next step."""
        masters = self.masters[name]
        for pname, param in self.groups.named_params(name):
            master = masters.get(pname)
            if master is not None and master.device != param.device:
                masters[pname] = self._mover.to_device(master, param.device)

    def _master(self, name: str, pname: str, param: nn.Parameter) -> torch.Tensor:
        """Group ``name``'s master of ``param``: created at its first step (or after a drop)
        from the stored (rounded) weights, so only groups that train ever hold one."""
        master = self.masters[name].get(pname)
        if master is None:
            master = self.masters[name][pname] = param.detach().to(dtype=torch.float32, copy=True)
        return master

    @property
    def master_policies(self) -> dict[str, StatePolicy]:
        """Each group's idle-master policy now (given, or the run's where it was left open)."""
        return {name: self.master_policy_of(name) for name in self.groups.names}

    def master_policy_of(self, name: str) -> StatePolicy:
        """Group ``name``'s idle-master policy now."""
        return self._given_master.get(name) or self._run_master

    def follow(
        self, source: PhaseSource, idle_state: Optional[StatePolicy] = None, idle_master: Optional[StatePolicy] = None
    ) -> None:
        """As :meth:`GroupedOptimizer.follow`; ``idle_master`` is the run's policy for masters left open
        (``None``: ``offload``)."""
        super().follow(source, idle_state, idle_master)
        self._run_master = idle_master or StatePolicy.OFFLOAD

    def summary(self, idle: Iterable[str], source: str) -> str:
        """What the ``idle`` groups' optimizer state and fp32 masters are now, under which policies and where."""
        idle = sorted(idle)
        held: dict[str, int] = {}
        for name in idle:
            for master in self.masters[name].values():
                held[master.device.type] = held.get(master.device.type, 0) + master.nbytes
        where = ", ".join(f"{n / 2**20:.1f} MiB on {device}" for device, n in sorted(held.items())) or "none"
        policies = "/".join(sorted({StatePolicy(self.master_policy_of(n)).value for n in idle}))
        return f"{super().summary(idle, source)}; idle fp32 masters: {policies or 'none'}, holding {where}"

    def _idle_master(self, name: str) -> None:
        policy = self.master_policy_of(name)
        if policy is StatePolicy.DROP:
            self.masters[name].clear()
        elif policy is StatePolicy.OFFLOAD:
            host = torch.device("cpu")
            for pname, master in list(self.masters[name].items()):
                if master.device.type != "cpu":
                    self.masters[name][pname] = self._mover.to_host(master, host)

    def master_bytes(self) -> dict[str, int]:
        """Bytes held by fp32 masters, by device type."""
        out: dict[str, int] = {}
        for masters in self.masters.values():
            for tensor in masters.values():
                out[tensor.device.type] = out.get(tensor.device.type, 0) + tensor.nbytes
        return out

    def fp32_grads(self) -> list[torch.Tensor]:
        """The fp32 gradients held for the masters now (what ``memory_report`` counts as ``master_grads``).

        The sums of a gradient-accumulation window, the buckets' slices
        all-reduced in fp32 (``allreduce_dtype=torch.float32``), and each
        master's ``.grad`` while a step runs (released after it).
        """
        held = [*self._grads32.accumulated.values(), *self._grads32.reduced.values()]
        return held + [m.grad for masters in self.masters.values() for m in masters.values() if m.grad is not None]

    # ------------------------------------------------------------------- step
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale (unchanged without loss scaling)."""
        if self.loss_scale is None:
            return loss
        self._loss_scaled = True
        return loss * self.loss_scale.scale

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        """Step the active groups on their fp32 masters; write the rounded values back.

        The stored parameters' gradients are consumed: cast to fp32 onto the
        masters one by one and released (``None`` after the step, as after
        ``zero_grad()``), so the step holds 4 bytes of gradient per trainable
        parameter (plus DDP's bucket in the storage dtype), not 6. With loss
        scaling, gradients are unscaled in fp32 and a step whose gradients are
        not all finite is skipped (``skipped_steps`` counts them).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.loss_scale is not None and not self._loss_scaled:
            raise AltParamsError(
                "PrecisionOptimizer.step: `loss_scale` is set but no loss was scaled since the last step; "
                "back-propagate `optimizer.scale_loss(loss)`, or build the optimizer with loss_scale=None"
            )
        self._loss_scaled = False
        inv = 1.0 if self.loss_scale is None else 1.0 / self.loss_scale.scale
        pairs: list[tuple[nn.Parameter, torch.Tensor]] = []  # (stored param, its fp32 master)
        found_inf = False
        active = self.active
        for name in active:
            for pname, param in self.groups.named_params(name):
                if not self._needs_master(param):
                    continue
                # fp32: all-reduced in fp32, or the accumulated sum, or param.grad cast up
                grad32 = self._grads32.take(param)  # param.grad released at once
                if grad32 is None:
                    continue
                master = self._master(name, pname, param)
                master.grad = grad32
                if inv != 1.0:
                    master.grad.mul_(inv)
                if self.loss_scale is not None and not bool(torch.isfinite(master.grad).all()):
                    found_inf = True
                pairs.append((param, master))
        if found_inf:
            self.skipped_steps += 1
        else:
            # The inner optimizers step the masters: they stand in for their parameters in
            # `param_groups` and `state` for the step (Python lists and dicts only; the stored
            # parameters are never touched, so DDP's autograd hooks on them stay valid).
            with masters_in_place(self.inner.values(), pairs):
                for name in self.groups.names:
                    if name in active:
                        self.inner[name].step()
            for param, master in pairs:
                param.detach().copy_(master)
        self.last_stepped = active
        for _, master in pairs:
            master.grad = None
        if self.loss_scale is not None:
            self.loss_scale.update(found_inf)
        return loss

    # ------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The :class:`GroupedOptimizer` state plus every existing fp32 master (on CPU) and the loss scale.

        Refused in the middle of a gradient-accumulation window (fp32 sums pending):
        save at an optimizer-step boundary, where a resumed run is exact.
        """
        if self._grads32.pending():
            raise AltParamsError(
                "PrecisionOptimizer.state_dict: called between backward passes of a gradient-accumulation "
                f"window ({self._grads32.pending()} bytes of fp32 gradient sums pending, not saved); save after "
                "optimizer.step() and zero_grad(), where a resumed run is exact"
            )
        out = super().state_dict()
        self._mover.settle()
        out["precision"] = {
            "format": PRECISION_FORMAT,
            "master_policies": {n: p.value for n, p in self.master_policies.items()},
            "masters": {n: {p: t.detach().to("cpu", copy=True) for p, t in m.items()} for n, m in self.masters.items()},
            "loss_scale": None if self.loss_scale is None else self.loss_scale.state_dict(),
            "skipped_steps": self.skipped_steps,
        }
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a :meth:`state_dict`: the optimizer state, then the masters (placed per policy)."""
        precision = state_dict.get("precision")
        if not isinstance(precision, Mapping) or precision.get("format") != PRECISION_FORMAT:
            raise PlanError(
                "PrecisionOptimizer.load_state_dict: the dict has no `precision` entry of format "
                f"{PRECISION_FORMAT!r} (it was not saved by PrecisionOptimizer.state_dict(); "
                "without the masters a resumed run would not be exact)"
            )
        saved = precision["masters"]
        if set(saved) != set(self.masters):
            raise PlanError(
                f"PrecisionOptimizer.load_state_dict: saved groups {sorted(saved)} "
                f"differ from this optimizer's groups {sorted(self.masters)}"
            )
        params = {n: dict(self.groups.named_params(n)) for n in self.groups.names}
        for name, masters in saved.items():
            unknown = sorted(set(masters) - set(params[name]))
            if unknown:
                raise PlanError(
                    f"PrecisionOptimizer.load_state_dict: group {name!r} has masters "
                    f"for unknown parameters {unknown[:5]}"
                )
            self.masters[name] = {
                p: t.to(device=params[name][p].device, dtype=torch.float32, copy=True) for p, t in masters.items()
            }
        if self.loss_scale is not None and precision.get("loss_scale") is not None:
            self.loss_scale.load_state_dict(precision["loss_scale"])
        self.skipped_steps = int(precision.get("skipped_steps", 0))
        super().load_state_dict(state_dict)
        # Torch casts loaded optimizer state to its parameter's dtype (the storage dtype):
        # put the saved fp32 values back.
        for name in self.groups.names:
            opt, saved_state = self.inner[name], state_dict["groups"][name]["state"]
            for pname, param in self.groups.named_params(name):
                for key, value in saved_state.get(pname, {}).items():
                    current = opt.state.get(param, {}).get(key)
                    if (
                        isinstance(value, torch.Tensor)
                        and isinstance(current, torch.Tensor)
                        and value.is_floating_point()
                        and current.dtype != value.dtype
                    ):
                        opt.state[param][key] = value.to(device=current.device, copy=True)
        self.enter_phase(self.active)  # masters and state placed per policy
