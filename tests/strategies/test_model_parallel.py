"""``lightning_zero/strategies/model_parallel.py`` without processes: the optimizer state keyed by parameter name
([Note: sharded model-parallel checkpoints]) and the templates DCP loads it into."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_zero.strategies.model_parallel import (
    by_position,
    check_state_dict_type,
    optimizer_state_template,
    parameter_names,
    rekey_optimizer_state,
)
from tests.helpers.parity import assert_optimizer_states_equal


def _stepped() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A net whose optimizer lists its parameters out of registration order, after one AdamW step."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(
        [{"params": [net[2].weight, net[0].weight]}, {"params": [net[0].bias, net[2].bias], "weight_decay": 0.0}]
    )
    net(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    return net, optimizer


def test_optimizer_state_keyed_by_name_and_back():
    net, optimizer = _stepped()
    names = parameter_names(optimizer, net)
    assert names == ["2.weight", "0.weight", "0.bias", "2.bias"]  # the optimizer's order, not the module's
    state = optimizer.state_dict()
    named = rekey_optimizer_state(state, dict(enumerate(names)))
    assert sorted(named["state"]) == sorted(names) and named["param_groups"][1]["params"] == ["0.bias", "2.bias"]
    assert named["state"]["0.weight"]["exp_avg"] is state["state"][1]["exp_avg"]
    assert_optimizer_states_equal(rekey_optimizer_state(named, {n: i for i, n in enumerate(names)}), state)
    assert_optimizer_states_equal(by_position(named, names), state)  # what a load does with either kind
    assert_optimizer_states_equal(by_position(state, names), state)
    with pytest.raises(ValueError, match=r"parameters \['2.bias'\], which this model does not have"):
        rekey_optimizer_state(named, {name: i for i, name in enumerate(names[:-1])})


def test_optimizer_state_template_reads_back_what_was_saved(tmp_path):
    """Templates of the saved shapes and dtypes for the parameters asked for (others are not read)."""
    net, optimizer = _stepped()
    named = rekey_optimizer_state(optimizer.state_dict(), dict(enumerate(parameter_names(optimizer, net))))
    dcp.save({"optimizer_0": {"state": named["state"]}}, checkpoint_id=tmp_path)
    metadata = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    template = optimizer_state_template(["0.weight", "2.bias"], metadata, "optimizer_0")
    assert sorted(template) == ["0.weight", "2.bias"]
    assert template["0.weight"]["exp_avg"].shape == net[0].weight.shape
    dcp.load({"optimizer_0": {"state": template}}, checkpoint_id=tmp_path)
    for name in template:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(template[name][key], named["state"][name][key]), (name, key)


def test_state_dict_type_is_checked():
    assert check_state_dict_type("sharded") == "sharded"
    with pytest.raises(ValueError, match="state_dict_type='dcp' is invalid: expected 'full' or 'sharded'"):
        check_state_dict_type("dcp")
