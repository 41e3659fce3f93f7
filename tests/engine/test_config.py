"""The switch's settings: one typed value (SwitchConfig), checked once, the same way for every entry point."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from hf_altparams.engine import PhaseSwitcher
from hf_altparams.engine.config import SwitchConfig
from hf_altparams.errors import AltParamsError, PlanError
from hf_altparams.integrations.trainer import AlternatingFreeze
from hf_altparams.plan import Alternating, ParamGroups


@pytest.mark.parametrize(
    "setting,value,message",
    [
        ("release", "sometimes", r"`release` is 'sometimes'; accepted: 'auto', True or False"),
        ("trim", "yes", r"`trim` must be True or False, got 'yes'"),
        ("prefetch", -1, r"`prefetch` is -1; accepted: False, True, 'auto' or a byte budget"),
        ("buffer_sync", "always", r"`buffer_sync` is 'always'; accepted: \['keep', 'auto'\]"),
        ("buffer_updating_types", (int,), r"`buffer_updating_types` must be nn.Module subclasses"),
        ("history_window", 0, r"`history_window` is 0; accepted: an int >= 1"),
        ("collective_timeout", 0, r"`collective_timeout` must be None .* or a positive number of seconds, got 0"),
        ("keep_reducers", -1, r"`keep_reducers` must be a whole number >= 0"),
        ("offload_device", "floppy", r"`offload_device` is 'floppy', which is not a torch device"),
    ],
)
def test_a_bad_setting_is_refused_naming_it_the_value_and_what_is_accepted(
    setting: str, value: object, message: str
) -> None:
    with pytest.raises(AltParamsError, match=message):
        SwitchConfig(**{setting: value})


def test_unknown_names_are_refused_with_the_accepted_list() -> None:
    with pytest.raises(PlanError, match=r"`switcher_options` has unknown keys \['prefech'\]; accepted: \['release',"):
        SwitchConfig.build({"prefech": True})
    with pytest.raises(PlanError, match=r"must be a SwitchConfig or a mapping"):
        SwitchConfig.build(["prefetch"])  # type: ignore[arg-type]


def test_build_overrides_and_replace_validates_again() -> None:
    base = SwitchConfig(prefetch="auto")
    built = SwitchConfig.build(base, keep_reducers=1)
    assert (built.prefetch, built.keep_reducers) == ("auto", 1)
    with pytest.raises(AltParamsError, match="keep_reducers"):
        dataclasses.replace(built, keep_reducers=-2)  # a changed copy is checked as a new one


def test_every_entry_point_checks_the_settings_at_construction() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
    with pytest.raises(PlanError, match=r"unknown keys \['prefech'\]"):
        PhaseSwitcher(groups, Alternating(["a", "b"]), prefech=True)
    with pytest.raises(PlanError, match=r"`switcher_options` has unknown keys \['prefech'\]"):
        AlternatingFreeze({"a": "0.*", "b": "1.*"}, Alternating(["a", "b"]), switcher_options={"prefech": True})
    assert all(p.requires_grad for p in net.parameters())  # nothing was applied


def test_a_config_object_and_keywords_give_the_same_switcher() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
    by_config = PhaseSwitcher(groups, Alternating(["a", "b"]), config=SwitchConfig(history_window=3, trim=False))
    by_keywords = PhaseSwitcher(groups, Alternating(["a", "b"]), history_window=3, trim=False)
    assert by_config.config == by_keywords.config
    assert by_config.history.window == 3
    torch.manual_seed(0)
