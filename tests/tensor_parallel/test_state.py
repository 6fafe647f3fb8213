"""Full state dicts in and out of a parallelized model, and :func:`unparallelize`, on 2 gloo ranks.

A whole-model state dict (other weights than the model's) is cut into the parallelized ``CharGPT`` with
``shard_state_dict``; ``full_state_dict`` gives it back exactly, and ``unparallelize`` rebuilds the plain model with
those weights: standard layers, the head count multiplied back, the same output as the plain model bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.demo.model import CharGPT
from lightning_zero.tensor_parallel import (
    GPT_PLAN,
    TensorParallelModule,
    full_state_dict,
    parallelize,
    shard_state_dict,
    unparallelize,
)
from tests.helpers.workers import run_workers


def _gpt() -> CharGPT:
    torch.manual_seed(0)
    return CharGPT(16, 8, 2, 4, 16, dropout=0.0)


def _worker() -> dict:
    dist.init_process_group("gloo")
    reference, model = _gpt(), parallelize(_gpt(), GPT_PLAN)
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(2.0)
    reference.head.weight.requires_grad_(False)
    model.head.weight.requires_grad_(False)
    full = reference.state_dict()
    model.load_state_dict(shard_state_dict(model, full))
    gathered = full_state_dict(model)
    unparallelize(model, GPT_PLAN)
    x = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(1))
    return {
        "full": full,
        "gathered": gathered,
        "after": model.state_dict(),
        "parallel_left": any(isinstance(m, TensorParallelModule) for m in model.modules()),
        "types": [type(m) for m in (model.wte, model.blocks[0].qkv, model.blocks[0].proj, model.head)],
        "n_head": [block.n_head for block in model.blocks],
        "frozen": not model.head.weight.requires_grad and model.blocks[0].qkv.weight.requires_grad,
        "outputs": (model(x).detach(), reference(x).detach()),
    }


@pytest.mark.timeout(120)
def test_full_state_dict_round_trip_and_unparallelize_restore_the_plain_model():
    for result in run_workers(_worker, 2, timeout=120):
        for name in ("gathered", "after"):
            assert result[name].keys() == result["full"].keys()
            assert all(torch.equal(result[name][k], v) for k, v in result["full"].items()), name
        assert not result["parallel_left"] and result["types"] == [nn.Embedding, nn.Linear, nn.Linear, nn.Linear]
        assert result["n_head"] == [4, 4] and result["frozen"]
        assert torch.equal(*result["outputs"])
