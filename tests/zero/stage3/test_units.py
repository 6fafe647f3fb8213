"""Unit planning for ZeRO-3 (``lightning_zero/zero/stage3/units.py``): pure, on meta-device modules, no processes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero.zero.stage3.units import ROOT, plan_units
from tests.helpers.parity import Block, TinyGPT


def _meta(factory):
    with torch.device("meta"):
        return factory()


def _owners(plans) -> dict[str, str]:
    return {param: plan.name for plan in plans for param in plan.param_names}


def test_default_units_are_the_children_of_the_outermost_containers():
    plans = plan_units(_meta(TinyGPT))
    assert [p.name for p in plans] == [ROOT, "blocks.0", "blocks.1"]
    owners = _owners(plans)
    assert owners["blocks.1.qkv.weight"] == "blocks.1"
    assert owners["wte.weight"] == ROOT and owners["ln_f.weight"] == ROOT
    # every parameter exactly once (the tied head weight is registered under its first name only)
    assert sorted(owners) == sorted(name for name, _ in _meta(TinyGPT).named_parameters())


def test_auto_wrap_policy_picks_instances_and_tied_weights_go_to_the_common_ancestor():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.b.weight = self.a.weight  # shared by two units

    plans = plan_units(_meta(Tied), auto_wrap_policy={nn.Linear})
    owners = _owners(plans)
    assert owners == {"a.weight": ROOT, "a.bias": "a", "b.bias": "b"}
    assert [p.name for p in plan_units(_meta(TinyGPT), auto_wrap_policy={Block})] == [ROOT, "blocks.0", "blocks.1"]


def test_min_num_params_wraps_bottom_up():
    model = _meta(lambda: nn.Sequential(nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 2)), nn.Linear(2, 2)))
    plans = plan_units(model, min_num_params=100)
    # 0.0 has 110 parameters; 0 has only 22 left beyond it; 1 has 6
    assert [p.name for p in plans] == [ROOT, "0.0"]
    assert _owners(plans)["0.1.weight"] == ROOT
    # 20: 0.0 (110) and 0.1 (22) qualify; then 0 has nothing left of its own
    assert [p.name for p in plan_units(model, min_num_params=20)] == [ROOT, "0.0", "0.1"]
    # a parent with enough parameters of its own around a child unit: nested units
    attention = _meta(lambda: nn.Sequential(nn.MultiheadAttention(8, 2)))
    assert [p.name for p in plan_units(attention, min_num_params=70)] == [ROOT, "0", "0.out_proj"]


def test_units_that_own_nothing_are_dropped_and_bad_settings_fail():
    model = _meta(lambda: nn.Sequential(nn.Linear(2, 2), nn.Tanh()))
    assert [p.name for p in plan_units(model)] == [ROOT, "0"]
    with pytest.raises(ValueError, match="exclusive"):
        plan_units(model, auto_wrap_policy={nn.Linear}, min_num_params=3)
    with pytest.raises(ValueError, match="min_num_params=0 is invalid: expected an integer >= 1"):
        plan_units(model, min_num_params=0)
