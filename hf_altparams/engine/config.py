"""The switch's settings as one typed value: :class:`SwitchConfig`, validated once when it is built.

Every entry point takes the same settings: ``PhaseSwitcher(groups, schedule,
config=SwitchConfig(...))`` (or the same names as keywords),
``PhasedAccelerator(..., switcher_options=...)`` and ``AlternatingFreeze(...,
switcher_options=...)`` (a ``SwitchConfig`` or a mapping of its field names).
A bad value or an unknown name is refused when the config is built, that is when
the entry point is constructed, before any model is touched: the error names
the setting, the value received and what would be accepted.

Example:
    >>> config = SwitchConfig(prefetch="auto", keep_reducers=1)
    >>> config.prefetch, config.release
    ('auto', 'auto')
    >>> SwitchConfig.build({"trim": False}, release=False).trim
    False
    >>> try:
    ...     SwitchConfig.build({"prefech": True})
    ... except PlanError as err:
    ...     print(str(err)[:58])
    `switcher_options` has unknown keys ['prefech']; accepted:
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from ..errors import PlanError
from .buffers import BufferSyncPolicy, FrozenNormPolicy, check_buffer_sync
from .collective import check_timeout
from .ddp import check_keep_reducers
from .drift import DriftSetting, check_drift_setting
from .memory import (
    DeviceLike,
    PrefetchSetting,
    ReleaseSetting,
    StatePolicy,
    StatePolicyLike,
    as_device,
    check_prefetch,
    check_release,
)
from .records import check_history_window

__all__ = ["SwitchConfig"]


def _check_bool(value: object, name: str) -> None:
    if not isinstance(value, bool):
        raise PlanError(f"`{name}` must be True or False, got {value!r}")


@dataclass(frozen=True)
class SwitchConfig:
    """How a :class:`~hf_altparams.engine.PhaseSwitcher` applies each switch.

    Args:
        release: when to run, after a switch, a young-generation gc pass,
            ``empty_cache`` and ``malloc_trim`` (the ranks are already in step:
            the switch ends with a collective). ``"auto"`` (default): when the
            coming phase needs less memory than was held and lasts long enough to
            amortise it; skipped when the next phase reuses the freed memory at
            once (equal-sized groups alternating). ``True``: at every switch;
            ``False``: never. The decision is in each record (``released``,
            ``release_reason``).
        full_gc: make that gc pass a full collection (80-300 ms with torch and
            transformers imported; a switch's garbage is freed by reference
            count, so this is only for user-side reference cycles).
        trim: let that release return freed host heap pages to the OS
            (``malloc_trim``): host RSS stays at what live tensors need, at
            10-50 ms per switch plus page faults in the next step.
        offload_device: where the groups a phase does not keep resident live
            (``Phase.resident``, e.g. the other tasks of ``PerTaskCycle``): their
            parameters, gradients and optimizer state. Default the CPU; ``None``
            leaves them in place (still out of DDP and guarded).
        device: where resident groups live (default: where each tensor left
            from, else the DDP wrapper's device).
        guard_offloaded: refuse, naming the parameter, a forward through a module
            whose parameters are all non-resident.
        prefetch: start copying the next phase's offloaded parameters and
            optimizer state back on a CUDA side stream during the last step of the
            current phase. ``False`` (default), ``True`` (everything), a byte
            budget (``int``), or ``"auto"`` (at most the headroom below the largest
            expected peak seen). Step schedules only; a no-op off CUDA.
        buffer_sync: ``"keep"`` (default: DDP's buffer broadcast as built) or
            ``"auto"`` (broadcast only while a module that updates its buffers in
            forward may train).
        frozen_norms: ``"train"`` (default) or ``"eval"``: hold norm layers whose
            parameters are frozen in a phase in eval mode.
        buffer_updating_types: module types besides norm layers that update
            buffers in forward.
        history_window: how many recent switch records the history keeps (its
            running totals cover every switch).
        collective_timeout: seconds a rank waits in a switch's agreement for the
            others before it raises a ``SwitchError`` naming the switch and the
            step (a rank died or hangs). ``None`` (default): the process group's
            timeout. The first switch after the wrapper is attached (or after a
            resume) always waits under the process group's timeout: ranks
            legitimately reach it seconds apart, after loading a model.
        keep_reducers: how many idle phases' DDP reducers to keep for switches
            back (default 0: a switch frees the old reducer and builds a new one).
            Each kept reducer holds one copy of its phase's trainable gradients;
            in return a switch back re-installs it (faster, with the bucket layout
            it learned). ``1`` suits two sets alternating every step.
        idle_state: what an idle group's optimizer state and fp32 master do
            where the optimizer leaves it open (a plain torch optimizer such as
            the Trainer's default AdamW; a ``GroupedOptimizer`` or
            ``PrecisionOptimizer`` built without ``state_policy`` /
            ``master_policy``): ``"keep"``, ``"offload"`` or ``"drop"``.
            ``None`` (default): the schedule's assumption
            (``schedule.idle_state``): ``"drop"`` for ``lisa`` and ``badam``
            (state and masters freed while a block is idle, as their published
            memory figures assume); otherwise state kept and masters offloaded.
        drift_check: when every rank's weights are compared (:mod:`.drift`; a
            ``DriftError`` names the groups and ranks that differ): ``"save"``
            (default) before every checkpoint of the integrations; ``"switch"``
            also after every switch; ``N`` also every ``N`` optimizer steps;
            ``False`` never.
    """

    release: ReleaseSetting = "auto"
    full_gc: bool = False
    trim: bool = True
    offload_device: Optional[DeviceLike] = "cpu"
    device: Optional[DeviceLike] = None
    guard_offloaded: bool = True
    prefetch: PrefetchSetting = False
    buffer_sync: BufferSyncPolicy = "keep"
    frozen_norms: FrozenNormPolicy = "train"
    buffer_updating_types: tuple[type, ...] = ()
    history_window: int = 256
    collective_timeout: Optional[float] = None
    keep_reducers: int = 0
    idle_state: Optional[StatePolicyLike] = None
    drift_check: DriftSetting = "save"

    def __post_init__(self) -> None:
        check_release(self.release)
        for name in ("full_gc", "trim", "guard_offloaded"):
            _check_bool(getattr(self, name), name)
        for name in ("offload_device", "device"):
            if getattr(self, name) is not None:
                as_device(getattr(self, name), name)
        check_prefetch(self.prefetch)
        object.__setattr__(self, "buffer_updating_types", tuple(self.buffer_updating_types))
        check_buffer_sync(self.buffer_sync, self.frozen_norms, self.buffer_updating_types)
        check_history_window(self.history_window)
        object.__setattr__(self, "collective_timeout", check_timeout(self.collective_timeout))
        check_keep_reducers(self.keep_reducers)
        if self.idle_state is not None:
            object.__setattr__(self, "idle_state", StatePolicy.parse(self.idle_state, "`idle_state`"))
        check_drift_setting(self.drift_check)

    @classmethod
    def names(cls) -> list[str]:
        """The settings' names, in order."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def build(
        cls,
        options: Union[None, SwitchConfig, Mapping[str, Any]] = None,
        *,
        argument: str = "switcher_options",
        **overrides: Any,
    ) -> SwitchConfig:
        """A config from ``options`` (a config, a mapping of setting names, or ``None``) and ``overrides``.

        ``argument`` names the user's argument in the error for an unknown name.
        """
        if options is None:
            base: dict[str, Any] = {}
        elif isinstance(options, SwitchConfig):
            base = dataclasses.asdict(options)
        elif isinstance(options, Mapping):
            base = dict(options)
        else:
            raise PlanError(
                f"`{argument}` must be a SwitchConfig or a mapping of its settings "
                f"({cls.names()}), got {type(options).__name__}: {options!r}"
            )
        merged = {**base, **overrides}
        unknown = sorted(set(merged) - set(cls.names()), key=str)
        if unknown:
            raise PlanError(f"`{argument}` has unknown keys {unknown}; accepted: {cls.names()}")
        return cls(**merged)
