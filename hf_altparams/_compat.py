"""Which torch versions hf_altparams accepts, and the check run at import.

The engine rebuilds a DDP reducer in place through private torch APIs, so the
library refuses a torch older than :data:`MIN_TORCH` at import time, with a
message that names the way out, instead of failing obscurely mid-training.

Example::

    >>> from hf_altparams._compat import MIN_TORCH, parse_torch_version
    >>> parse_torch_version("2.13.0+cpu")
    (2, 13)
    >>> parse_torch_version("2.11.0a0+git1234abc") >= MIN_TORCH
    True
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Sequence

from .errors import AltParamsError

__all__ = [
    "MIN_TORCH",
    "TESTED_TORCH",
    "check_torch_at_import",
    "parse_torch_version",
    "torch_version",
]

#: Oldest (major, minor) torch release the library imports on.
MIN_TORCH: tuple[int, int] = (2, 11)

#: Inclusive range of (major, minor) torch releases the library is written and
#: tested against: ``TESTED_TORCH[0] <= torch_version() <= TESTED_TORCH[1]``.
TESTED_TORCH: tuple[tuple[int, int], tuple[int, int]] = ((2, 11), (2, 13))

#: Environment variable that lets an untested torch version through the backends' fences (with a warning).
ALLOW_UNTESTED_ENV = "HF_ALTPARAMS_ALLOW_UNTESTED_TORCH"

_VERSION_RE = re.compile(r"^\s*(\d+)\.(\d+)")


@functools.lru_cache(maxsize=8)  # read at every DDP rebuild; the string never changes in a process
def parse_torch_version(version: str) -> tuple[int, int]:
    """Return ``(major, minor)`` of a torch version string.

    Local labels and pre-release tags are ignored: ``"2.13.0+cpu"``,
    ``"2.11.0a0+git1234abc"`` and ``"2.12.0.dev20260101"`` parse to
    ``(2, 13)``, ``(2, 11)`` and ``(2, 12)``.

    Raises:
        AltParamsError: if ``version`` does not start with ``MAJOR.MINOR``.
    """
    match = _VERSION_RE.match(version)
    if match is None:
        raise AltParamsError(
            f"cannot parse torch version {version!r}: expected it to start with `MAJOR.MINOR`, e.g. '2.13.0+cpu'"
        )
    return int(match.group(1)), int(match.group(2))


def torch_version() -> tuple[int, int]:
    """Return ``(major, minor)`` of the installed torch (read from ``torch.__version__``)."""
    import torch

    return parse_torch_version(str(torch.__version__))


def _fmt(version: tuple[int, int]) -> str:
    return ".".join(str(part) for part in version)


def check_torch_at_import() -> None:
    """Refuse to import on a torch older than :data:`MIN_TORCH`.

    Raises:
        AltParamsError: naming the torch version found, the minimum, and the
            pip command that fixes it.
    """
    import torch

    found = str(torch.__version__)
    if parse_torch_version(found) < MIN_TORCH:
        minimum = _fmt(MIN_TORCH)
        raise AltParamsError(
            f"hf_altparams requires torch>={minimum}, but torch {found} is installed "
            f"(at {getattr(torch, '__file__', '?')}). "
            f"Upgrade it with: pip install --upgrade 'torch>={minimum}'"
        )


def library_version(version: str) -> tuple[int, int]:
    """``(major, minor)`` of another library's version string; ``(0, 0)`` if it has none.

    Example:
        >>> library_version("1.15.0.dev0"), library_version("unknown")
        ((1, 15), (0, 0))
    """
    match = _VERSION_RE.match(version)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def check_library_at_import(
    library: str, version: str, tested: tuple[tuple[int, int], tuple[int, int]], missing: Sequence[str], what: str
) -> None:
    """A fence's check at import: refuse ``library`` lacking ``missing`` names; warn outside the ``tested`` range.

    Args:
        library: the package name (``"accelerate"``).
        version: its ``__version__``.
        tested: the lowest and highest ``(major, minor)`` tested.
        missing: the names the fence relies on that the installed version lacks.
        what: what those names are, for the messages (``"Accelerate internals"``).

    Raises:
        AltParamsError: a name is missing (naming them and the tested releases).
    """
    low, high = tested
    if missing:
        raise AltParamsError(
            f"hf_altparams relies on {what} {list(missing)} that {library} {version} lacks; install a tested "
            f"release ({library} {_fmt(low)} to {_fmt(high)})"
        )
    if not low <= library_version(version) <= high:
        warnings.warn(
            f"hf_altparams: {library} {version} is outside the tested range {_fmt(low)} to {_fmt(high)}; the "
            f"{what} it uses are present, but run tests/integrations/test_fences.py to be sure",
            stacklevel=3,
        )
