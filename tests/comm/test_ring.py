"""The ring all-reduce: its schedule (pure), then parity with ``dist.all_reduce`` and its ledger on gloo processes."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import pytest
import torch
import torch.distributed as dist

from lightning_zero.comm import collectives as comm
from lightning_zero.comm.groups import torch_reduce_op
from lightning_zero.comm.ring import (
    chunk_bounds,
    ring_all_reduce,
    ring_schedule,
    ring_send_bytes,
    segment_bounds,
)
from tests.helpers.workers import run_workers

MIB = 2**20


@pytest.mark.parametrize("numel", [0, 1, 2, 3, 7, 1000, 1001])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_segments_are_tensor_split_and_chunks_cover_them_exactly(numel, n):
    bounds = segment_bounds(numel, n)
    sizes = [stop - start for start, stop in bounds]
    assert sizes == [len(part) for part in torch.tensor_split(torch.arange(numel), n)]
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in pairwise(bounds))  # contiguous, in order
    for chunk_numel in (1, 3, 64, 10_000):
        for start, stop in bounds:
            chunks = chunk_bounds(start, stop, chunk_numel)
            covered = [i for lo, hi in chunks for i in range(lo, hi)]
            assert covered == list(range(start, stop))  # every element once, in order
            assert all(0 < hi - lo <= chunk_numel for lo, hi in chunks)
            assert len(chunks) == -(-(stop - start) // chunk_numel)


def test_chunk_bounds_refuses_empty_chunks():
    with pytest.raises(ValueError, match="chunk_numel must be >= 1"):
        chunk_bounds(0, 4, 0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_schedule_reduces_every_contribution_exactly_once_then_gathers_it_everywhere(n):
    """Simulate the ring symbolically: a segment is the multiset of ranks whose contribution it has summed."""
    schedules = [ring_schedule(n, r) for r in range(n)]
    assert all(len(s) == 2 * (n - 1) for s in schedules)
    held = [[Counter({r: 1}) for _ in range(n)] for r in range(n)]  # held[rank][segment]
    for s in range(2 * (n - 1)):
        for r in range(n):  # what a rank sends is what its right neighbour receives
            assert schedules[r][s].send == schedules[(r + 1) % n][s].recv
        sent = [held[r][schedules[r][s].send].copy() for r in range(n)]
        for r in range(n):
            step = schedules[r][s]
            incoming = sent[(r - 1) % n]
            held[r][step.recv] = held[r][step.recv] + incoming if step.phase == "reduce_scatter" else incoming
        if s == n - 2:  # end of phase 1: rank r owns the complete segment r + 1
            for r in range(n):
                assert held[r][(r + 1) % n] == Counter(range(n))
                received = [step.recv for step in schedules[r][: n - 1]]
                assert sorted(received) == sorted(set(range(n)) - {r})  # each other segment combined once
    everything = Counter(range(n))
    assert all(segment == everything for rank_segments in held for segment in rank_segments)


@pytest.mark.parametrize("numel", [1, 5, 1000, 1001, 3 * MIB // 4])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_send_bytes_are_2_n_minus_1_over_n_of_the_input_up_to_rounding(numel, n):
    for r in range(n):
        sent = ring_send_bytes(numel, 4, n, r)
        ideal = 2 * (n - 1) / n * numel * 4
        assert abs(sent - ideal) <= 2 * (n - 1) * 4  # at most one element per step off
        if numel % n == 0:
            assert sent == ideal


def test_schedule_and_bad_arguments_are_refused_with_the_allowed_values():
    with pytest.raises(ValueError, match="rank 3 is not in a ring of 3"):
        ring_schedule(3, 3)
    expected = r"algorithm 'tree' is invalid: expected one of \('native', 'ring', 'hierarchical'\)"
    with pytest.raises(ValueError, match=expected):
        comm.all_reduce(torch.zeros(2), algorithm="tree")
    with pytest.raises(ValueError, match="reduce op 'median' is invalid"):
        comm.all_reduce(torch.zeros(2), "median", algorithm="ring")
    with pytest.raises(ValueError, match="ring all-reduce op 'band' is invalid"):
        ring_all_reduce(torch.zeros(2), "band")
    with pytest.raises(ValueError, match="chunk_bytes must be >= 1"):
        ring_all_reduce(torch.zeros(2), chunk_bytes=0)
    assert comm.ALL_REDUCE_ALGORITHM == "native"


def test_a_ring_of_one_is_a_no_op_recorded_as_an_all_reduce():
    x = torch.arange(6.0).view(2, 3)
    handle = comm.all_reduce(x, "avg", algorithm="ring", async_op=True, tag="solo")
    handle.wait()
    assert torch.equal(x, torch.arange(6.0).view(2, 3))
    assert comm.LEDGER.summary() == {("all_reduce", "solo"): (1, 24)}


def _cases(n: int) -> list[tuple[str, torch.Tensor, str, int]]:
    """``(name, this rank's data, op, chunk_bytes)``: sizes 1, N-1, N+1, 1000 and 3 MiB; several chunks in flight."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1234 + rank)
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for numel in sorted({1, n - 1, n + 1, 1000}):
            for op in ("sum", "avg", "max", "min"):
                x = torch.randn(numel, generator=g).to(dtype)
                chunk = 64 if numel >= 1000 else x.element_size()  # several chunks per segment
                cases.append((f"{dtype} numel={numel} {op} chunked", x, op, chunk))
        for op in ("sum", "avg", "max", "min"):
            x = torch.randn(3 * MIB // 4, generator=g).to(dtype)
            cases.append((f"{dtype} 3 MiB-of-fp32 {op} 64 KiB chunks", x, op, 64 * 1024))
        cases.append((f"{dtype} 3 MiB-of-fp32 sum default chunks", torch.randn(3 * MIB // 4, generator=g), "sum", 0))
    cases.append(("float32 product", 1 + 0.1 * torch.randn(100, generator=g), "product", 40))
    return cases


def _exact_cases() -> list[tuple[str, torch.Tensor, str]]:
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(99 + rank)
    ints = torch.randint(-1000, 1000, (10_007,), generator=g)
    halves = torch.randint(-64, 64, (5003,), generator=g).float() / 4  # fp32 sums of these are exact in any order
    return [("int64 sum", ints, "sum"), ("int32 max", ints.int(), "max"), ("fp32 exact sum", halves, "sum")]


def _compare(ours: torch.Tensor, native: torch.Tensor, exact: bool) -> str | None:
    try:
        if exact:
            assert torch.equal(ours, native), f"max diff {(ours.double() - native.double()).abs().max()}"
        elif ours.dtype == torch.bfloat16:
            torch.testing.assert_close(ours, native, rtol=2e-2, atol=5e-2)
        else:
            torch.testing.assert_close(ours, native, rtol=1e-5, atol=1e-5)
    except AssertionError as error:
        return str(error).splitlines()[0]
    return None


def _ring_worker(n: int) -> dict:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    failures: dict[str, str] = {}

    def check(name: str, data: torch.Tensor, op: str, exact: bool, group=None, **ring_kwargs) -> None:
        ours, native = data.clone(), data.clone()
        ring_all_reduce(ours, op, group=group, tag="cmp", **ring_kwargs)
        dist.all_reduce(native, op=torch_reduce_op(op), group=group)
        if (failure := _compare(ours, native, exact)) is not None:
            failures[name] = failure

    for name, data, op, chunk in _cases(n):
        # max, min and (two-term) sums do not depend on the reduction order: bit-identical
        exact = op in ("max", "min") or (n == 2 and op == "sum")
        check(name, data, op, exact, **({"chunk_bytes": chunk} if chunk else {}))
    for name, data, op in _exact_cases():
        check(name, data, op, exact=True, chunk_bytes=1000)

    # non-contiguous input, through the shim, asynchronously, communicated in bf16
    x = torch.randn(40, 30, generator=torch.Generator().manual_seed(rank)).t()
    native = x.contiguous()
    dist.all_reduce(native)
    ours = x.clone().t().contiguous().t()  # the same non-contiguous layout
    assert not ours.is_contiguous()
    comm.all_reduce(ours, "sum", algorithm="ring", async_op=True, tag="shim").wait()
    if (failure := _compare(ours, native, exact=n == 2)) is not None:
        failures["non-contiguous"] = failure
    wire_native, wire_ours = x.to(torch.bfloat16), x.clone()
    dist.all_reduce(wire_native)
    comm.all_reduce(wire_ours, "sum", algorithm="ring", dtype=torch.bfloat16)
    assert wire_ours.dtype == torch.float32
    if (failure := _compare(wire_ours.to(torch.bfloat16), wire_native, exact=n == 2)) is not None:
        failures["dtype=bf16"] = failure

    # the ledger: input bytes as an all_reduce, wire bytes as sends
    comm.LEDGER.reset()
    for numel in (1000, 1001, 7):
        ring_all_reduce(torch.ones(numel), tag=f"ledger{numel}", chunk_bytes=256)
    ledger = {
        numel: (
            comm.LEDGER.summary()[("all_reduce", f"ledger{numel}")],
            comm.LEDGER.summary()[("send", f"ledger{numel}")],
        )
        for numel in (1000, 1001, 7)
    }

    # groups that are not the world (ranks mapped to global ones), a ring of 2 and a ring of 3
    for members in [[1, 2]] if n == 3 else [[0, 2], [1, 2, 3]] if n == 4 else []:
        group = dist.new_group(members)  # every rank takes part in creating it
        if rank in members:
            g = torch.Generator().manual_seed(7 + rank)
            for op in ("sum", "avg", "max"):  # avg divides by the group's size
                data = torch.randn(1001, generator=g)
                exact = op == "max" or len(members) == 2
                check(f"group {members} {op}", data, op, exact, group=group, chunk_bytes=128)
    return {"failures": failures, "ledger": ledger}


@pytest.mark.timeout(240)
# 4 also runs rings of 2 and 3 in subgroups
@pytest.mark.parametrize("n", [2, *(pytest.param(n, marks=pytest.mark.slow) for n in (3, 4))])
def test_ring_equals_native_all_reduce_and_ledger_counts_wire_bytes(n):
    results = run_workers(_ring_worker, n, n, timeout=200)
    for rank, result in enumerate(results):
        assert result["failures"] == {}, f"rank {rank}"
        for numel, (all_reduce, send) in result["ledger"].items():
            assert all_reduce == (1, numel * 4)
            assert send == (2 * (n - 1), ring_send_bytes(numel, 4, n, rank))
    if n == 4:  # 1000 = 4 x 250 fp32: exactly 2(N-1)/N of the input
        assert results[0]["ledger"][1000][1][1] == 2 * 3 * 1000 * 4 // 4
