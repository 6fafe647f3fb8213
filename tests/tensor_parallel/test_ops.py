"""Megatron's f and g and the last-dimension gather/scatter pair, on gloo processes, against the plain computation.

Each operator runs forward and backward with per-rank or replicated data (regenerated here from the seeds), and the
ledger shows which direction communicates. The 4-rank run splits the world into two tensor-parallel pairs, so the
operators must stay inside their ``group``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_zero.comm import collectives as comm
from lightning_zero.tensor_parallel import (
    copy_to_parallel_region,
    gather_from_parallel_region,
    reduce_from_parallel_region,
    scatter_to_parallel_region,
)
from tests.helpers.workers import run_workers

ROWS, WIDTH = 3, 2  # activations (ROWS, WIDTH) per rank, (ROWS, N * WIDTH) in full
OPS = {
    "f": copy_to_parallel_region,
    "g": reduce_from_parallel_region,
    "gather": gather_from_parallel_region,
    "scatter": scatter_to_parallel_region,
}


def _data(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _inputs(op: str, group_index: int, global_rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input, upstream gradient)`` of ``op`` on a rank: per-rank data where the operator's side of the region is
    sharded, one seed per group where it is replicated."""
    mine, shared = 100 + global_rank, 200 + group_index
    return {
        "f": (_data(shared, ROWS, WIDTH), _data(mine, ROWS, WIDTH)),
        "g": (_data(mine, ROWS, WIDTH), _data(shared, ROWS, WIDTH)),
        "gather": (_data(mine, ROWS, WIDTH), _data(shared, ROWS, n * WIDTH)),
        "scatter": (_data(shared, ROWS, n * WIDTH), _data(mine, ROWS, WIDTH)),
    }[op]


def _ops_worker(groups: list[list[int]]) -> dict:
    dist.init_process_group("gloo")
    handles = [dist.new_group(members) for members in groups]  # every rank creates every group, in order
    index = next(i for i, members in enumerate(groups) if dist.get_rank() in members)
    group = handles[index]
    out = {}
    for name, op in OPS.items():
        x, upstream = _inputs(name, index, dist.get_rank(), len(groups[index]))
        x.requires_grad_()
        comm.LEDGER.reset()
        y = op(x, group)
        forward = comm.LEDGER.summary()
        comm.LEDGER.reset()
        y.backward(upstream)
        out[name] = {"y": y.detach(), "grad": x.grad, "forward": forward, "backward": comm.LEDGER.summary()}
    return out


def _expected(op: str, groups: list[list[int]], global_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The single-process ``(output, input gradient)`` of ``op`` on ``global_rank``."""
    index = next(i for i, members in enumerate(groups) if global_rank in members)
    members, n = groups[index], len(groups[index])
    r = members.index(global_rank)
    everyone = [_inputs(op, index, member, n) for member in members]
    x, upstream = everyone[r]
    if op == "f":  # identity; the gradient is the sum of every rank's
        return x, sum(u for _, u in everyone)
    if op == "g":  # the sum; the gradient passes through
        return sum(xs for xs, _ in everyone), upstream
    if op == "gather":  # concatenation; the gradient's own slice
        return torch.cat([xs for xs, _ in everyone], dim=-1), upstream[:, r * WIDTH : (r + 1) * WIDTH]
    return x[:, r * WIDTH : (r + 1) * WIDTH], torch.cat([u for _, u in everyone], dim=-1)  # scatter


def _ledger(op: str, n: int) -> tuple[dict, dict]:
    """(forward, backward) ledger summaries: one collective in exactly one direction."""
    reduce_bytes, gather_bytes = ROWS * WIDTH * 4, ROWS * n * WIDTH * 4
    return {
        "f": ({}, {("all_reduce", "tp"): (1, reduce_bytes)}),
        "g": ({("all_reduce", "tp"): (1, reduce_bytes)}, {}),
        "gather": ({("all_gather", "tp"): (1, gather_bytes)}, {}),
        "scatter": ({}, {("all_gather", "tp"): (1, gather_bytes)}),
    }[op]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("groups", [[[0, 1]], [[0, 1], [2, 3]]], ids=["world2", "two_pairs_of_world4"])
def test_conjugate_ops_match_the_plain_computation_and_communicate_one_way(groups):
    results = run_workers(_ops_worker, sum(map(len, groups)), groups)
    for global_rank, result in enumerate(results):
        n = next(len(members) for members in groups if global_rank in members)
        for op in OPS:
            y, grad = _expected(op, groups, global_rank)
            torch.testing.assert_close(result[op]["y"], y, rtol=0, atol=1e-6, msg=f"{op} forward")
            torch.testing.assert_close(result[op]["grad"], grad, rtol=0, atol=1e-6, msg=f"{op} backward")
            assert (result[op]["forward"], result[op]["backward"]) == _ledger(op, n), op


def test_one_rank_needs_no_process_group_and_communicates_nothing():
    x = _data(0, ROWS, WIDTH).requires_grad_()
    for op in OPS.values():
        x.grad = None
        y = op(x)
        y.backward(_data(1, ROWS, WIDTH))
        assert torch.equal(y, x) and torch.equal(x.grad, _data(1, ROWS, WIDTH))
    assert comm.LEDGER.records == []
