"""The loss scale of fp16 storage (:class:`~hf_altparams.engine.PrecisionOptimizer`'s ``loss_scale``)."""

from __future__ import annotations

from typing import Any, Mapping

from ...errors import PlanError

__all__ = ["DynamicLossScale"]


class DynamicLossScale:
    """A loss scale that halves on a non-finite gradient and doubles after ``growth_interval`` clean steps.

    Example:
        >>> s = DynamicLossScale(init_scale=8.0, growth_interval=2)
        >>> s.update(found_inf=True); s.scale
        4.0
        >>> s.update(False); s.update(False); s.scale
        8.0
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_interval: int = 2000, dynamic: bool = True) -> None:
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
