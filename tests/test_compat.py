"""Torch version parsing and the import-time check."""

from __future__ import annotations

import pytest
import torch

from hf_altparams import AltParamsError, _compat


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("2.13.0", (2, 13)),
        ("2.13.0+cpu", (2, 13)),
        ("2.11.0a0+git1234abc", (2, 11)),
        ("2.12.0.dev20260101+cu128", (2, 12)),
        ("3.0.1", (3, 0)),
        ("10.2", (10, 2)),
    ],
)
def test_parse_torch_version(version: str, expected: tuple[int, int]) -> None:
    assert _compat.parse_torch_version(version) == expected


def test_parse_torch_version_rejects_garbage() -> None:
    with pytest.raises(AltParamsError, match="cannot parse torch version 'nightly'"):
        _compat.parse_torch_version("nightly")


def test_installed_torch_passes_the_check() -> None:
    _compat.check_torch_at_import()
    assert _compat.torch_version() >= _compat.MIN_TORCH


def test_too_old_torch_is_refused_with_a_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.10.2+cu126")
    with pytest.raises(AltParamsError) as info:
        _compat.check_torch_at_import()
    message = str(info.value)
    assert "torch 2.10.2+cu126" in message  # the version found
    assert "torch>=2.11" in message  # the minimum
    assert "pip install --upgrade 'torch>=2.11'" in message  # the way out


def test_min_torch_itself_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.11.0a0+gitabcdef")
    _compat.check_torch_at_import()


def test_tested_range_is_well_formed() -> None:
    low, high = _compat.TESTED_TORCH
    assert _compat.MIN_TORCH <= low <= high


def test_a_fence_refuses_a_library_lacking_its_names_and_warns_outside_the_tested_range() -> None:
    """The check both fences (accelerate_internals, transformers_internals) run at import."""
    import warnings

    tested = ((1, 0), (1, 15))
    with pytest.raises(
        AltParamsError,
        match=r"relies on Accelerate internals \['Accelerator._optimizers'\] that "
        r"accelerate 1.16.0 lacks; install a tested release \(accelerate 1.0 "
        r"to 1.15\)",
    ):
        _compat.check_library_at_import(
            "accelerate", "1.16.0", tested, ["Accelerator._optimizers"], "Accelerate internals"
        )
    with pytest.warns(UserWarning, match=r"accelerate 1.16.0 is outside the tested range 1.0 to 1.15"):
        _compat.check_library_at_import("accelerate", "1.16.0", tested, [], "Accelerate internals")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compat.check_library_at_import("accelerate", "1.15.0.dev0", tested, [], "Accelerate internals")
