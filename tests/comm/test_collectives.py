"""The collectives shim on real gloo processes: the substitutes equal the native ops, and the ledger counts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_zero.comm import collectives as comm
from lightning_zero.comm.ledger import CommLedger
from tests.helpers.workers import run_workers


def _collectives_worker(world_size: int) -> dict:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    comm.LEDGER.reset()
    g = torch.Generator().manual_seed(rank)
    k = 10  # per-rank chunk
    data = torch.randn(world_size * k, generator=g)

    native_rs = torch.empty(k)
    dist.reduce_scatter_single(native_rs, data.clone())
    shard = data[:k].clone()
    native_ag = torch.empty(world_size * k)
    dist.all_gather_single(native_ag, shard)

    ours = {}
    # The threshold picks the gloo substitutes or the native ops; the substitutes also with pieces of 3 elements
    # (3, 3, 3, 1 of each chunk of 10: [Note: gloo pieces]).
    for substitutes, piece_bytes in ((True, comm.GLOO_PIECE_BYTES), (True, 12), (False, comm.GLOO_PIECE_BYTES)):
        comm.GLOO_SUBSTITUTE_MIN_BYTES = 0 if substitutes else 1 << 40
        comm.GLOO_PIECE_BYTES = piece_bytes
        ours_rs = torch.empty(k)
        handle = comm.reduce_scatter(ours_rs, data.clone(), async_op=True, tag="t")
        handle.wait()
        ours_ag = torch.full((world_size * k,), float("nan"))
        comm.all_gather(ours_ag, shard, tag="t")
        ours[substitutes, piece_bytes] = (ours_rs, ours_ag)

    summed = data.clone()
    comm.all_reduce(summed, "avg", tag="avg")
    stacked = comm.all_gather_stack(torch.tensor([rank, rank * 10.0]))
    obj = comm.broadcast_object({"from": rank}, src=0)
    return {
        "native": (native_rs, native_ag),
        "ours": ours,
        "avg": summed,
        "data": data,
        "stacked": stacked,
        "obj": obj,
        "summary": comm.LEDGER.summary(),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_gloo_substitutes_equal_native_ops_and_ledger_counts_inputs(world_size):
    results = run_workers(_collectives_worker, world_size, world_size)
    everyone = torch.stack([r["data"] for r in results])
    for r in results:
        native_rs, native_ag = r["native"]
        for ours_rs, ours_ag in r["ours"].values():
            torch.testing.assert_close(ours_rs, native_rs, rtol=0, atol=1e-6)
            assert torch.equal(ours_ag, native_ag)
        torch.testing.assert_close(r["avg"], everyone.mean(0))
        assert r["stacked"].tolist() == [[q, q * 10.0] for q in range(world_size)]
        assert r["obj"] == {"from": 0}
        summary = r["summary"]
        assert summary[("reduce_scatter", "t")] == (3, 3 * world_size * 10 * 4)
        assert summary[("all_gather", "t")] == (3, 3 * world_size * 10 * 4)  # gathered (output) bytes
        assert summary[("all_reduce", "avg")] == (1, world_size * 10 * 4)


def test_bad_shapes_and_ops_are_rejected_with_the_numbers():
    with pytest.raises(ValueError, match="reduce op 'median' is invalid"):
        comm.all_reduce(torch.zeros(2), "median")
    # without a process group the world size is 1
    with pytest.raises(ValueError, match="input has 4 elements: expected world_size=1 x output 2"):
        comm.reduce_scatter(torch.zeros(2), torch.zeros(4))
    with pytest.raises(ValueError, match="output has 3 elements: expected world_size=1 x input 2"):
        comm.all_gather(torch.zeros(3), torch.zeros(2))


def test_ledger_selects_by_op_and_tag():
    ledger = CommLedger()
    ledger.record("all_reduce", "grads", 100)
    ledger.record("all_reduce", "log", 4)
    ledger.record("broadcast", "grads", 8)
    assert ledger.bytes() == 112
    assert ledger.bytes(op="all_reduce") == 104
    assert ledger.bytes(tag="grads") == 108
    assert ledger.calls(op="all_reduce", tag="grads") == 1
    assert ledger.summary()[("all_reduce", "log")] == (1, 4)


def _all_to_all_worker(world_size: int) -> dict:
    """Rank r sends rank q the pieces ``[q * 10 + r] * (q + 1)`` and ``[r] * q`` (sizes depend on the receiver: the
    second piece is empty for q = 0), two calls in flight at once."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    comm.LEDGER.reset()
    handles, received = [], []
    for call in range(2):
        inputs = [
            [torch.full((q + 1,), q * 10.0 + rank + call), torch.full((q,), float(rank))] for q in range(world_size)
        ]
        outputs = [[torch.empty(rank + 1), torch.empty(rank)] for _ in range(world_size)]
        handles.append(comm.all_to_all(outputs, inputs, async_op=True, tag="a2a"))
        received.append(outputs)
    for handle in handles:
        handle.wait()
    return {"received": received, "ledger": comm.LEDGER.bytes("all_to_all", "a2a")}


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_to_all_of_uneven_and_empty_pieces(world_size):
    results = run_workers(_all_to_all_worker, world_size, world_size)
    for rank, out in enumerate(results):
        for call, outputs in enumerate(out["received"]):
            for src, (first, second) in enumerate(outputs):
                assert torch.equal(first, torch.full((rank + 1,), rank * 10.0 + src + call))
                assert torch.equal(second, torch.full((rank,), float(src)))
        assert out["ledger"] == 2 * 4 * world_size * (2 * rank + 1)  # what this rank received, its own pieces included
