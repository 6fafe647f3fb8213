"""Ring all-reduce written from scratch on point-to-point sends: :func:`ring_all_reduce`.

[Note: ring all-reduce] The N ranks of a group form a ring: rank ``r`` only ever sends to its right neighbour
``(r + 1) mod N`` and receives from its left neighbour ``(r - 1) mod N``. The flat tensor is split into N segments
(``torch.tensor_split``: sizes differ by at most one element; some are empty when the tensor has fewer than N
elements), and the reduction runs in two phases of N-1 steps each (:func:`ring_schedule`):

1. **reduce-scatter**: at step ``s`` rank ``r`` sends segment ``(r - s) mod N`` and receives segment
   ``(r - s - 1) mod N``, which it combines into its own copy. Each segment travels once around the ring picking up
   one contribution per hop, so after N-1 steps rank ``r`` holds the fully reduced segment ``(r + 1) mod N``;
2. **all-gather**: at step ``s`` rank ``r`` sends segment ``(r + 1 - s) mod N`` and receives segment
   ``(r - s) mod N``, which it copies: every reduced segment travels once more around the ring.

Cost: each rank sends (and receives) one segment per step, so 2(N-1)/N x the tensor's bytes in all, whatever N
(within a segment's rounding); that is the bandwidth optimum for an all-reduce. The price is latency: 2(N-1)
sequential steps, each a neighbour round trip, so small messages favour algorithms with fewer steps.

**Chunked and pipelined.** Within a step a segment goes as chunks of at most ``chunk_bytes``: every chunk's
``irecv`` and ``isend`` is posted at once, and each received chunk is reduced as soon as it has arrived, while the
later chunks are still on the wire. Reduction (phase 1) thus overlaps transfer instead of following it.

**Why it exists beside the backend's all-reduce.** ``dist.all_reduce`` is a black box whose algorithm depends on
the backend, its version and the message size (gloo picks among ring, bcube and halving-doubling; NCCL among ring
and tree). Owning one makes the wire bytes visible in :data:`~lightning_zero.comm.ledger.LEDGER` (each
step's send is recorded as ``("send", tag, bytes)``, next to the usual ``("all_reduce", tag, input bytes)``), gives
a reference to measure the backend against, and a place to change the algorithm (chunk size, reduction order,
compression) without a custom backend. It is selected with ``collectives.all_reduce(..., algorithm="ring")``; the
default stays the native one until ``benchmarks/ring_allreduce.py`` measures ours faster.

The reduction order differs from the backend's, so floating-point results may differ from ``dist.all_reduce`` in
the last bits (integer sums, max and min are exact). Every rank must call with tensors of the same numel and dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import Tensor

from lightning_zero.comm.groups import LOCAL_REDUCE, rank, world_size
from lightning_zero.comm.ledger import LEDGER

CHUNK_BYTES = 2**20
"""Default largest point-to-point message of :func:`ring_all_reduce` (one chunk of a segment).

``benchmarks/ring_allreduce.py --sizes 16 --ranks 2 --chunk-kib 64 256 1024 4096 16384``, median ms on a busy
2-core machine (indicative only): 64 KiB 81, 256 KiB 42, 1 MiB 36, 4 MiB 36, 16 MiB (one chunk per segment: no
pipelining) 43; native ``dist.all_reduce`` 28. Small chunks pay a per-message cost; one chunk per segment
serialises transfer and reduction.
"""

_COMBINE: dict[str, Callable[[Tensor, Tensor], Any]] = {**LOCAL_REDUCE, "product": Tensor.mul_}
"""In-place ``out = out (op) received`` per reduce op name."""


@dataclass(frozen=True)
class RingStep:
    """One step of the ring on one rank: the segment it sends right and the one it receives from the left."""

    phase: str  # "reduce_scatter" (combine what is received) or "all_gather" (copy it)
    send: int
    recv: int


def segment_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each of the ``world_size`` segments of a flat tensor, as ``torch.tensor_split`` cuts it."""
    size, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for i in range(world_size):
        stop = start + size + (i < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def chunk_bounds(start: int, stop: int, chunk_numel: int) -> list[tuple[int, int]]:
    """``[start, stop)`` cut into consecutive chunks of at most ``chunk_numel`` elements (none when empty)."""
    if chunk_numel < 1:
        raise ValueError(f"chunk_numel must be >= 1, got {chunk_numel}")
    return [(lo, min(lo + chunk_numel, stop)) for lo in range(start, stop, chunk_numel)]


def ring_schedule(world_size: int, rank: int) -> list[RingStep]:
    """The 2(N-1) steps of rank ``rank`` in a ring of ``world_size``: N-1 reduce-scatter, then N-1 all-gather."""
    n = world_size
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} is not in a ring of {n}")
    reduce = [RingStep("reduce_scatter", (rank - s) % n, (rank - s - 1) % n) for s in range(n - 1)]
    gather = [RingStep("all_gather", (rank + 1 - s) % n, (rank - s) % n) for s in range(n - 1)]
    return reduce + gather


def ring_send_bytes(numel: int, element_size: int, world_size: int, rank: int) -> int:
    """Bytes rank ``rank`` sends in one ring all-reduce of ``numel`` elements: about 2(N-1)/N x the input."""
    bounds = segment_bounds(numel, world_size)
    sent = sum(bounds[step.send][1] - bounds[step.send][0] for step in ring_schedule(world_size, rank))
    return sent * element_size


def _wait(work: dist.Work | None) -> None:
    """Wait for a point-to-point transfer; ``None`` is what torch returns to a rank outside the group (never here:
    the ring's peers are in it)."""
    if work is not None:
        work.wait()


def ring_all_reduce(
    tensor: Tensor,
    op: str = "sum",
    *,
    group: Any = None,
    tag: str = "",
    chunk_bytes: int = CHUNK_BYTES,
) -> None:
    """In-place all-reduce of ``tensor`` over ``group`` by the chunked, pipelined ring ([Note: ring all-reduce]).

    ``op`` is ``"sum"``, ``"avg"``/``"mean"`` (a sum divided by N at the end), ``"max"``, ``"min"`` or
    ``"product"``. A non-contiguous ``tensor`` is reduced in a contiguous copy that is copied back. Synchronous.
    """
    if op not in _COMBINE:
        raise ValueError(f"ring all-reduce op {op!r} is invalid: expected one of {sorted(_COMBINE)}")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    LEDGER.record("all_reduce", tag, tensor.numel() * tensor.element_size())
    n = world_size(group)
    if n == 1:
        return
    flat = tensor.contiguous().view(-1)  # ``tensor`` itself when contiguous
    me = rank(group)
    right, left = (me + 1) % n, (me - 1) % n
    if group is not None:
        right, left = dist.get_global_rank(group, right), dist.get_global_rank(group, left)
    bounds = segment_bounds(flat.numel(), n)
    chunk_numel = max(1, chunk_bytes // flat.element_size())
    scratch = flat.new_empty(max(stop - start for start, stop in bounds))  # phase 1 receives here
    combine = _COMBINE[op]
    for step in ring_schedule(n, me):
        send_lo, send_hi = bounds[step.send]
        recv_lo, recv_hi = bounds[step.recv]
        LEDGER.record("send", tag, (send_hi - send_lo) * flat.element_size())
        reducing = step.phase == "reduce_scatter"
        # Phase 1 receives into ``scratch`` (then combines); phase 2 straight into the tensor.
        target, offset = (scratch, recv_lo) if reducing else (flat, 0)
        received = [
            (lo, hi, dist.irecv(target[lo - offset : hi - offset], left, group=group))
            for lo, hi in chunk_bounds(recv_lo, recv_hi, chunk_numel)
        ]
        sends = [dist.isend(flat[lo:hi], right, group=group) for lo, hi in chunk_bounds(send_lo, send_hi, chunk_numel)]
        for lo, hi, work in received:
            _wait(work)
            if reducing:  # overlaps the transfer of the chunks after this one
                combine(flat[lo:hi], scratch[lo - recv_lo : hi - recv_lo])
        for work in sends:
            _wait(work)
    if op in ("avg", "mean"):
        flat.div_(n)
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
