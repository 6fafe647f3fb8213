"""ZeRO-1/2's engine alone (``lightning_zero/zero/stage12.py``, no Lightning) on real gloo processes: gradients
stored and accumulated in ``accum_dtype``."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.zero.stage12 import ShardedOptimizer
from tests.helpers.workers import run_workers

WORLD, STEPS, MICRO = 2, 2, 2
MODES = [(1, "boundary"), (1, "microbatch"), (2, "microbatch"), (2, "boundary")]
LR = 0.5


def _net() -> nn.Module:
    """Integer weights: SGD's updates (multiples of LR / WORLD) are exact in fp32 too."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 3, bias=False))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randint(-4, 5, p.shape))
    return net


def _batches() -> torch.Tensor:
    """Small integers: every gradient and every sum of them is exact in bf16, so any difference is a wrong sum."""
    g = torch.Generator().manual_seed(3)
    return torch.randint(-3, 4, (WORLD, STEPS, MICRO, 2, 6), generator=g).float()


WEIGHTS = torch.tensor([1.0, -2.0, 3.0])  # the loss weights each output differently, and linearly


def _loss(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (net[1](x @ torch.ones(6, 4, dtype=x.dtype)) * WEIGHTS.to(x.dtype)).sum() + net[0](x).sum()


def _fit(stage: int, grad_sync: str, accum_dtype: torch.dtype | None) -> dict:
    rank = dist.get_rank()
    net = _net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    engine = ShardedOptimizer(
        net, optimizer, stage=stage, grad_sync=grad_sync, bucket_cap_bytes=64, accum_dtype=accum_dtype
    )
    group = engine.groups[0]
    storage = group.flat_grad if engine.persistent else group.shard_grad
    dropped = []
    for step in range(STEPS):
        for micro in range(MICRO):
            boundary = micro == MICRO - 1
            with engine.reducer.no_sync() if grad_sync == "boundary" and not boundary else nullcontext():
                _loss(net, _batches()[rank, step, micro]).backward()
        engine.before_step()
        optimizer.step()
        engine.after_step()
        dropped.append(group.shard.grad is None)
        optimizer.zero_grad(set_to_none=True)
    return {"state": {k: v.clone() for k, v in net.state_dict().items()}, "storage": storage.dtype, "dropped": dropped}


def _all_modes() -> dict:
    dist.init_process_group("gloo")
    return {(s, m, d): _fit(s, m, d) for s, m in MODES for d in (None, torch.bfloat16)}


def _reference() -> dict[str, torch.Tensor]:
    """SGD on the ranks' summed micro-batch gradients, averaged over ranks, in float64."""
    net = _net().double()
    batches = _batches().double()
    for step in range(STEPS):
        net.zero_grad()
        for rank in range(WORLD):
            for micro in range(MICRO):
                (_loss(net, batches[rank, step, micro]) / WORLD).backward()
        with torch.no_grad():
            for p in net.parameters():
                p -= LR * p.grad
    return {k: v.float() for k, v in net.state_dict().items()}


@pytest.fixture(scope="module")
def fits():
    return run_workers(_all_modes, WORLD)


@pytest.mark.parametrize(("stage", "grad_sync"), MODES)
@pytest.mark.parametrize("accum_dtype", [None, torch.bfloat16])
def test_gradients_accumulate_in_accum_dtype_exactly(fits, stage, grad_sync, accum_dtype):
    """Two optimizer steps of two micro-batches each: the weights equal the reference exactly (so each window starts
    from zero and sums every micro-batch), the gradient storage has ``accum_dtype``, and the optimizer's copy of a
    cast shard gradient is dropped after the step."""
    expected = _reference()
    for rank_fits in fits:
        run = rank_fits[(stage, grad_sync, accum_dtype)]
        assert run["storage"] == (accum_dtype or torch.float32)
        for name, value in expected.items():
            assert torch.equal(run["state"][name], value), (name, run["state"][name], value)
        assert run["dropped"] == [accum_dtype is not None] * STEPS
