"""The hierarchical all-reduce (``lightning_zero/comm/hierarchy.py``): the node layout without processes, then the
three stages against gloo's flat all-reduce on 4 processes arranged as 2 nodes x 2, 4 x 1 and 1 x 4."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from lightning_zero.comm import collectives as comm
from lightning_zero.comm.hierarchy import inter_node_bytes, node_layout
from tests.helpers.workers import run_workers


def test_node_layout_is_torchruns_numbering():
    layout = node_layout(4, 2)
    assert layout.nodes == ((0, 1), (2, 3))
    assert layout.leaders == (0, 2)
    assert layout.node_of(3) == (2, 3)
    assert node_layout(3, 1).nodes == ((0,), (1,), (2,))
    assert node_layout(4, 4).leaders == (0,)


@pytest.mark.parametrize(("world", "local"), [(4, 3), (4, 0), (2, 4)])
def test_a_layout_that_does_not_divide_is_refused_with_the_numbers(world, local):
    with pytest.raises(ValueError, match=f"local_world_size={local} is invalid for world_size={world}"):
        node_layout(world, local)


def test_inter_node_bytes_of_the_flat_ring_and_of_the_hierarchy():
    assert inter_node_bytes(100, 4, 2, "ring") == 150  # 2(N-1)/N at N = 4
    assert inter_node_bytes(100, 4, 2, "hierarchical") == 100  # 2(M-1)/M at M = 2 nodes
    assert inter_node_bytes(100, 8, 2, "hierarchical") == 150  # 4 nodes
    assert inter_node_bytes(100, 4, 4, "ring") == 0  # one node: nothing crosses


def _worker(local_world_size: int) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    out: dict = {}
    # integers in floats: every summation order gives the same bits, so the comparison is exact
    for op in ("sum", "avg", "max", "min"):
        data = torch.randint(-50, 50, (1000,), generator=g).float() * 4  # avg over 4 ranks stays exact
        flat, ours = data.clone(), data.clone()
        comm.all_reduce(flat, op)
        comm.all_reduce(ours, op, algorithm="hierarchical", tag="h")
        out[op] = (flat, ours)
    # several calls in flight at once are served in order; sizes 0, 1 and odd
    tensors = [torch.randn(n, generator=g) for n in (0, 1, 333, 100_000)]
    flats = [t.clone() for t in tensors]
    for t in flats:
        comm.all_reduce(t, "avg")
    handles = [comm.all_reduce(t, "avg", async_op=True, algorithm="hierarchical") for t in tensors]
    for handle in handles:
        handle.wait()
    out["in_flight"] = (flats, tensors)
    # communicated in another dtype (a copy, cast back on completion)
    data = torch.randn(64, generator=g)
    wire = data.clone()
    comm.all_reduce(wire, "sum", algorithm="hierarchical", dtype=torch.bfloat16)
    out["bf16"] = (data, wire)
    out["ledger"] = comm.LEDGER.bytes("all_reduce", "h")
    errors = []
    for call in (
        lambda: comm.all_reduce(torch.ones(2), "product", algorithm="hierarchical"),
        lambda: comm.all_reduce(torch.ones(2), "sum", algorithm="hierarchical", group=dist.new_group([0, 1, 2, 3])),
    ):
        try:
            call()
        except ValueError as error:
            errors.append(str(error))
    out["errors"] = errors
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("local_world_size", [2, 1, 4], ids=["2x2", "4x1", "1x4"])
def test_hierarchical_all_reduce_equals_the_flat_one(local_world_size):
    results = run_workers(_worker, 4, local_world_size, timeout=150)
    for r in results:
        for op in ("sum", "avg", "max", "min"):
            flat, ours = r[op]
            assert torch.equal(flat, ours), op
        for flat, ours in zip(*r["in_flight"]):
            torch.testing.assert_close(ours, flat, rtol=1e-6, atol=1e-6)
        assert torch.equal(r["bf16"][1], results[0]["bf16"][1])  # the same bits on every rank
        assert r["ledger"] == 4 * 1000 * 4  # four calls of 4000 bytes tagged "h"
        assert r["errors"] == [
            "all_reduce algorithm 'hierarchical' takes op in ('sum', 'avg', 'mean', 'max', 'min'): got 'product'",
            "all_reduce algorithm 'hierarchical' runs over the default process group only: got a subgroup",
        ]
    everyone = sum(r["bf16"][0] for r in results)
    torch.testing.assert_close(results[0]["bf16"][1], everyone, rtol=3e-2, atol=3e-2)  # bf16 sums on the wire
