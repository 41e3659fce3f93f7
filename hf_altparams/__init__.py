"""hf_altparams: train alternating or changing parameter groups under DDP.

Only the parameters of the current phase are trained, all-reduced and kept
resident; switching phases rebuilds the DDP reducer in place, on every rank at
the same optimizer-step boundary.
"""

from __future__ import annotations

from ._compat import check_torch_at_import

check_torch_at_import()

__version__ = "0.1.0"

# ---------------------------------------------------------------------------
# Public API. Everything users may import from `hf_altparams` is listed in
# `__all__`; internals live in underscore modules or subpackages.
# (Re-exports of plan / engine / integrations are added as each lands.)
# ---------------------------------------------------------------------------
from .errors import AltParamsError, PlanError, SwitchError

__all__ = [
    "AltParamsError",
    "PlanError",
    "SwitchError",
    "__version__",
]
