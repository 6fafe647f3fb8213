"""``reduce_to_owners`` (``lightning_zero/comm/owners.py``) on gloo: uneven and empty pieces, in another dtype, in
pieces smaller than a message, against the sum of every rank's contribution."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_zero.comm import collectives as comm
from lightning_zero.comm.owners import reduce_to_owners
from tests.helpers.workers import run_workers

SIZES = [7, 0, 1000, 3]  # per owner; rank 1 owns nothing


def _contribution(rank: int, world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randint(-9, 9, (SIZES[q % len(SIZES)],), generator=g).float() for q in range(world)]


def _worker(world: int) -> dict:
    dist.init_process_group("gloo")
    me = dist.get_rank()
    out = {}
    for name, dtype, piece_bytes in (("fp32", None, comm.GLOO_PIECE_BYTES), ("bf16", torch.bfloat16, 8)):
        comm.GLOO_PIECE_BYTES = piece_bytes  # 8 bytes: every piece goes as several messages
        pieces = _contribution(me, world)
        comm.LEDGER.reset()
        reduce_to_owners(pieces, tag="t", dtype=dtype).wait()
        out[name] = pieces[me]
        out[name, "ledger"] = comm.LEDGER.bytes("reduce", "t")
    try:
        reduce_to_owners([torch.ones(1)])
    except ValueError as error:
        out["error"] = str(error)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_each_owner_gets_the_sum_of_its_piece(world):
    results = run_workers(_worker, world, world, timeout=100)
    for me, r in enumerate(results):
        expected = sum(_contribution(rank, world)[me] for rank in range(world))
        assert torch.equal(r["fp32"], expected)  # integers: exact in any order
        assert torch.equal(r["bf16"], expected)  # small integers are exact in bf16 too
        assert r["fp32", "ledger"] == 4 * sum(SIZES[q % len(SIZES)] for q in range(world))
        assert r["bf16", "ledger"] == 2 * sum(SIZES[q % len(SIZES)] for q in range(world))  # the wire's bytes
        assert r["error"] == f"reduce_to_owners got 1 pieces: expected one per rank of the group, {world}"
