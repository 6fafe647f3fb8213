"""ZeRO-1/2's engine alone (``lightning_zero/zero/stage12.py``, no Lightning) on real gloo processes: gradients
stored and accumulated in ``accum_dtype``, and global-norm clipping against torch's."""

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


def _full_grads(engine: ShardedOptimizer) -> list[torch.Tensor]:
    """Each parameter's whole gradient, from every rank's shard gradient."""
    group = engine.groups[0]
    pieces = [torch.empty_like(group.shard.grad) for _ in range(WORLD)]
    dist.all_gather(pieces, group.shard.grad)
    flat = torch.cat(pieces)
    return [flat.narrow(0, o, p.numel()).view_as(p).clone() for p, o in zip(group.params, group.layout.offsets)]


def _clip(widths: tuple[int, int, int]) -> dict:
    """One backward of ``Linear(w0, w1) -> Linear(w1, w2)`` (no biases) on random data, clipped by the engine and,
    from the same averaged gradients, by ``torch.nn.utils.clip_grad_norm_``."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(widths[0], widths[1], bias=False), nn.Linear(widths[1], widths[2], bias=False))
    optimizer = torch.optim.SGD(net.parameters(), lr=1.0)
    engine = ShardedOptimizer(net, optimizer, stage=2, bucket_cap_bytes=64)
    x = torch.randn(3, widths[0], generator=torch.Generator().manual_seed(dist.get_rank()))
    (net(x) * torch.linspace(-1, 2, widths[2])).sum().backward()
    engine.before_step()
    params = [nn.Parameter(torch.zeros_like(p)) for p in engine.groups[0].params]
    for p, grad in zip(params, _full_grads(engine)):
        p.grad = grad
    expected = torch.nn.utils.clip_grad_norm_(params, 0.1)
    total = engine.clip_grad_norm_(0.1)
    return {"total": (total, expected), "grads": list(zip(_full_grads(engine), (p.grad for p in params)))}


def _clips() -> dict:
    return {widths: _clip(widths) for widths in [(6, 4, 6), (5, 4, 3)]}


def test_clipping_is_torchs_bit_for_bit_where_no_parameter_is_cut():
    """``(6, 4, 6)``: 24 + 24 elements, the shard boundary between the two weights; the clipped gradients and the
    norm are those of ``torch.nn.utils.clip_grad_norm_`` bit for bit ([Note: clipping as torch does]). ``(5, 4, 3)``:
    20 + 12, the second weight cut by the boundary, its norm from its pieces: within 1e-6."""
    results = run_workers(_clips, WORLD)
    for rank_results in results:
        exact, cut = rank_results[6, 4, 6], rank_results[5, 4, 3]
        assert torch.equal(*exact["total"]) and all(torch.equal(ours, torchs) for ours, torchs in exact["grads"])
        assert exact["total"][0] > 0.2  # so the gradients were scaled
        assert torch.allclose(*cut["total"], rtol=1e-6, atol=0)
        assert all(torch.allclose(ours, torchs, rtol=1e-6, atol=1e-9) for ours, torchs in cut["grads"])
