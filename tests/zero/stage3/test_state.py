"""Loading a full model state into ZeRO-3's shards (``lightning_zero/zero/stage3/state.py``) with and without strict
key checking, as ``nn.Module.load_state_dict`` does it, on two gloo processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.zero.stage3 import state as sp_state
from lightning_zero.zero.stage3.engine import ShardedParams
from tests.helpers.workers import run_workers


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def _full_weights(engine: ShardedParams) -> dict[str, torch.Tensor]:
    with engine.summon_full_params():
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _load(engine: ShardedParams, state: dict, strict: bool) -> str | None:
    try:
        sp_state.load_model_state_dict(engine, state, strict)
    except ValueError as error:
        return str(error)
    return None


def _worker() -> dict:
    dist.init_process_group("gloo")
    try:
        engine = ShardedParams(_net())
        before = _full_weights(engine)
        other = {k: v + 1 for k, v in _net().state_dict().items()}
        missing = {k: v for k, v in other.items() if k != "2.bias"}
        out = {
            "missing_strict": _load(engine, missing, strict=True),
            "unexpected_strict": _load(engine, {**other, "extra.weight": torch.zeros(1)}, strict=True),
            "unchanged": all(torch.equal(before[k], v) for k, v in _full_weights(engine).items()),
            "missing_loose": _load(engine, {**missing, "extra.weight": torch.zeros(1)}, strict=False),
        }
        after = _full_weights(engine)
        out["loaded"] = all(torch.equal(after[k], missing[k]) for k in missing)
        out["kept"] = torch.equal(after["2.bias"], before["2.bias"])
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_strict_loading_checks_every_key_before_any_weight_changes_and_loose_loading_skips():
    for out in run_workers(_worker, 2, timeout=90):
        assert "missing keys ['2.bias'], unexpected keys []" in out["missing_strict"]
        assert "missing keys [], unexpected keys ['extra.weight']" in out["unexpected_strict"]
        assert out["unchanged"]
        assert out["missing_loose"] is None
        assert out["loaded"] and out["kept"]
