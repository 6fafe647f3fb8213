"""Reduce pieces of uneven size into the ranks that own them: :func:`reduce_to_owners`, ZeRO-1/2's
``grad_reduction="reduce_scatter"`` ([Note: gradient reduction] in ``lightning_zero/zero/stage12_reduction.py``).

[Note: reduce to owners] A gradient bucket cut where shards end gives each group rank ``q`` a piece of its own size
(some empty): a reduce-scatter with uneven chunks. NCCL reduces each piece into its owner with ``dist.reduce``,
one call per owner. On gloo those calls run one after another, and each moves data one way only: at N = 2 the
piece for rank 0 travels 1 -> 0 while the link 0 -> 1 idles, then the other way round, so the bucket takes as long as
an all-reduce of it although each rank sends half of it. The lab measured ZeRO-2's step in this mode at 1.18x the
all-reduce mode's (docs/benchmarks.md). So on gloo every pair of ranks exchanges its pieces point to point, all in
flight at once and sent in pieces of at most ``GLOO_PIECE_BYTES`` ([Note: gloo pieces] in
``lightning_zero/comm/collectives.py``), each piece's send posted next to the matching receive, and each owner sums
the N contributions in rank order. A 25 MiB bucket on 2 nodes at 1 Gbit/s (``lightning-zero-netlab``, median of 5):
one ``dist.reduce`` per owner 297 ms, gloo's all-reduce 219 ms, this exchange 114 ms (194 ms with every send of a
peer posted before its receives: one direction at a time again), the shim's reduce-scatter of equal chunks 114 ms.
Either way the ledger records ``("reduce", tag, bytes)`` per non-empty piece, this rank's contribution on the wire.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.comm import collectives as comm


def reduce_to_owners(
    pieces: Sequence[Tensor], *, group: Any = None, tag: str = "", dtype: torch.dtype | None = None
) -> comm.Handle:
    """Sum every rank's ``pieces[q]`` into group rank ``q``'s ``pieces[q]``, in place on the owner (the other ranks'
    copies of it are left undefined, as by ``dist.reduce``). ``pieces[q]`` has the same size on every rank; sizes may
    differ from owner to owner and be 0. With ``dtype`` the pieces are sent and summed in it, and the owner's sum is
    cast back. The pieces must stay untouched until the handle has been waited on."""
    n, me = comm.world_size(group), comm.rank(group)
    if len(pieces) != n:
        raise ValueError(f"reduce_to_owners got {len(pieces)} pieces: expected one per rank of the group, {n}")
    if comm.backend(group) != "gloo" or n == 1:
        handles = []
        for q, piece in enumerate(pieces):
            if piece.numel():
                dst = comm.global_rank(q, group)
                handles.append(comm.reduce(piece, dst, "sum", group=group, async_op=True, tag=tag, dtype=dtype))
        return comm.Handle(handles)
    mine = pieces[me]
    wire = [p if dtype is None or p.dtype == dtype else p.to(dtype) for p in pieces]
    received = {q: torch.empty_like(wire[me]) for q in range(n) if q != me}
    works = []
    step = max(1, comm.GLOO_PIECE_BYTES // max(1, wire[me].element_size()))
    for q in range(n):
        if pieces[q].numel():  # as comm.reduce records it: the bytes on the wire
            comm.LEDGER.record("reduce", tag, comm.nbytes_of(wire[q]))
        if q == me:
            continue
        peer = comm.global_rank(q, group)
        sends = wire[q].split(step) if wire[q].numel() else ()
        receives = received[q].split(step) if mine.numel() else ()
        for i in range(max(len(sends), len(receives))):  # interleaved: both directions of the pair carry data at once
            works += [dist.isend(sends[i], peer, group=group)] if i < len(sends) else []
            works += [dist.irecv(receives[i], peer, group=group)] if i < len(receives) else []

    def combine() -> None:  # the owner's sum, in rank order, into a buffer of its own
        if not mine.numel():
            return
        total = wire[0] if me == 0 else received[0]
        for q in range(1, n):
            total.add_(wire[me] if q == me else received[q])
        if total.data_ptr() != mine.data_ptr():
            mine.copy_(total)

    nbytes = sum(comm.nbytes_of(p) for p in wire)
    handle = comm.finish(works, True, then=combine, op="reduce", tag=tag, nbytes=nbytes, group=group)
    assert handle is not None  # async_op=True
    return handle
