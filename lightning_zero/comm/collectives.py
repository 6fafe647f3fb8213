"""The collectives shim: every collective that lightning_zero issues goes through this module.

It has these jobs.

1. **The communication ledger.** Each call is recorded in :data:`LEDGER` (:mod:`~lightning_zero.comm.ledger`) as
   ``(op, tag, bytes)``, where ``bytes`` is the size of the *input* this rank contributes, except for all-gathers,
   which record the gathered *output* (an all-reduce of a 100 MiB bucket records 100 MiB whatever the algorithm puts
   on the wire; gathering a 100 MiB parameter from N shards records 100 MiB). The quantized collectives
   (:mod:`lightning_zero.comm.quantized`) record what goes on the wire in those terms: int8 values plus fp32 scales.
   Tests and benchmarks read it to prove, for example, that a non-boundary micro-batch communicates nothing. Tags
   name the purpose (``"grads"``, ``"sync_states"``, ``"log"``...).

2. **Primitive choice per backend.** [Note: gloo substitutes] On gloo (torch 2.13) ``reduce_scatter`` is a clone
   plus a full all-reduce plus a copy, and ``all_gather_into_tensor`` allocates a full-size temporary; both are slower
   than ``all_reduce`` for large messages. ``benchmarks/collectives.py`` measured, 2 ranks, median ms native vs
   substitute: reduce-scatter 1 MiB 1.8 vs 3.8, 4 MiB 7.3 vs 4.8, 64 MiB 94 vs 65, 128 MiB 147 vs 91; all-gather
   (pairwise, 2026-12-07) 4 MiB 1.5 vs 1.3, 16 MiB 8.1 vs 3.6, 64 MiB 48 vs 19, 128 MiB 108 vs 35. So on gloo, from
   :data:`GLOO_SUBSTITUTE_MIN_BYTES` of input up:

   - reduce-scatter  = pairwise exchange: each rank sends chunk ``d`` of its input to rank ``d`` and receives its own
     chunk from every other rank (point-to-point, all in flight at once), then sums the N contributions in rank
     order. Each rank sends and receives (N-1)/N of the input, half of what an all-reduce moves; 2 ranks, median ms:
     12.6 MiB 4.8 (all-reduce 9.4, native 16.7), 34 MiB 21.8 (27.6, 51.6);
   - all-gather      = pairwise exchange too: each rank sends its input to every other rank and receives theirs
     straight into the preallocated output.

   [Note: gloo pieces] gloo serves one direction of a pair at a time per message: one isend and one irecv of 32 MiB
   each way between two nodes on 1 Gbit/s links took 560 ms (median of 10), twice the 282 ms of both directions at
   once; the same exchange in 4, 16 and 64 pieces took 350, 298 and 284 ms (``lightning-zero-netlab``, about
   ideal x (1 + 1/pieces)), and on loopback 64 MiB cost the same in 1 to 64 pieces. So both pairwise exchanges send
   pieces of at most :data:`GLOO_PIECE_BYTES`; the result is the same bit for bit (the sum order does not change).

   ``input`` must stay untouched until the returned handle has been waited on.

   NCCL (and any other backend) keeps the native ``reduce_scatter_single`` / ``all_gather_single``.

3. **All-reduce algorithm.** ``all_reduce(..., algorithm=...)`` picks ``"native"`` (``dist.all_reduce``) or
   ``"ring"`` (:func:`lightning_zero.comm.ring.ring_all_reduce`, see [Note: ring all-reduce]); ``None`` means
   :data:`ALL_REDUCE_ALGORITHM`.

4. **Quantized collectives** (ZeRO++'s qwZ and qgZ, [Note: quantized reduce-scatter]): in
   :mod:`lightning_zero.comm.quantized` send blockwise int8 with fp32 scales and dequantize on completion.

Asynchronous calls return a :class:`Handle` whose ``wait()`` also runs any copy-out (or dequantization) it needs.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.comm import hierarchy, watchdog
from lightning_zero.comm.groups import LOCAL_REDUCE, ReduceOpName, torch_reduce_op

# The process-group queries and the ledger are part of the shim's API (``comm.rank()``, ``comm.LEDGER``): explicit
# re-exports of their own modules' names, which the ring imports without importing the shim.
from lightning_zero.comm.groups import backend as backend
from lightning_zero.comm.groups import global_rank as global_rank
from lightning_zero.comm.groups import is_initialized as is_initialized
from lightning_zero.comm.groups import rank as rank
from lightning_zero.comm.groups import rendezvous_store as rendezvous_store
from lightning_zero.comm.groups import world_size as world_size
from lightning_zero.comm.ledger import LEDGER as LEDGER
from lightning_zero.comm.ring import ring_all_reduce

# torch 2.13 renamed the flat collectives; the old names warn on every call.
_reduce_scatter_native = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_native = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

ALL_REDUCE_ALGORITHMS = ("native", "ring", "hierarchical")
ALL_REDUCE_ALGORITHM = "native"
"""The algorithm of :func:`all_reduce` when the call names none (one of :data:`ALL_REDUCE_ALGORITHMS`)."""

GLOO_SUBSTITUTE_MIN_BYTES = 4 * 2**20
"""Smallest message (reduce-scatter input, all-gather output) for which gloo uses the substitutes."""

GLOO_PIECE_BYTES = 512 * 2**10
"""The pairwise reduce-scatter sends each peer's chunk in pieces of at most this many bytes ([Note: gloo pieces])."""


class Handle:
    """A pending collective: one or more ``torch.distributed`` works plus an optional copy-out to run after them.
    ``label`` names it in a timeout's message; ``bounded``: its waits are bounded by ``collective_timeout``
    ([Note: collective watchdog] in ``lightning_zero/comm/watchdog.py``)."""

    def __init__(
        self,
        works: Sequence[Any] = (),
        then: Callable[[], object] | None = None,
        label: str = "a collective",
        bounded: bool = False,
    ) -> None:
        self._works = [w for w in works if w is not None]
        self._then = then
        self._label, self._bounded = label, bounded

    def wait(self) -> None:
        for work in self._works:
            work.wait() if isinstance(work, Handle) else watchdog.wait(work, self._label, self._bounded)
        self._works = []
        if self._then is not None:
            then, self._then = self._then, None
            then()


def nbytes_of(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes} bytes"


def uses_gloo_substitutes(nbytes: int, group: Any = None) -> bool:
    """Whether a reduce-scatter/all-gather moving ``nbytes`` uses the gloo substitutes (see the module docstring)."""
    return nbytes >= GLOO_SUBSTITUTE_MIN_BYTES and dist.get_backend(group) == "gloo"


def finish(
    works: Sequence[Any],
    async_op: bool,
    then: Callable[[], object] | None = None,
    *,
    op: str = "",
    tag: str = "",
    nbytes: int = 0,
    group: Any = None,
) -> Handle | None:
    """The handle of ``works`` (the backend's, always started asynchronously), waited on here unless ``async_op``."""
    label = f"{op} {tag!r} of {_size(nbytes)}" if op else "a collective"
    handle = Handle(works, then, label, bounded=bool(works) and watchdog.timed(op, tag, group))
    if async_op:
        return handle
    handle.wait()
    return None


def _in_dtype(tensor: Tensor, dtype: torch.dtype | None) -> Tensor | None:
    """A copy of ``tensor`` in ``dtype`` to communicate, or ``None`` when it already is in it."""
    return None if dtype is None or dtype == tensor.dtype else tensor.to(dtype)


def all_reduce(
    tensor: Tensor,
    op: ReduceOpName = "sum",
    *,
    group: Any = None,
    async_op: bool = False,
    tag: str = "",
    dtype: torch.dtype | None = None,
    algorithm: str | None = None,
    ranks_per_node: int | None = None,
) -> Handle | None:
    """In-place all-reduce of ``tensor``, communicated in ``dtype`` when given (a copy, cast back on completion).

    ``algorithm``: ``"native"``, ``"ring"`` or ``"hierarchical"``, default :data:`ALL_REDUCE_ALGORITHM`. The ring is
    synchronous: with ``async_op=True`` it has completed when the call returns, and the handle it returns is already
    finished. The hierarchy ([Note: hierarchical all-reduce] in ``lightning_zero/comm/hierarchy.py``) runs over the
    default group only, with nodes of ``ranks_per_node`` ranks (default ``LOCAL_WORLD_SIZE``), on its own worker
    thread.
    """
    algorithm = ALL_REDUCE_ALGORITHM if algorithm is None else algorithm
    if algorithm not in ALL_REDUCE_ALGORITHMS:
        raise ValueError(f"all_reduce algorithm {algorithm!r} is invalid: expected one of {ALL_REDUCE_ALGORITHMS}")
    wire = _in_dtype(tensor, dtype)
    if wire is not None:
        handle = all_reduce(
            wire, op, group=group, async_op=True, tag=tag, algorithm=algorithm, ranks_per_node=ranks_per_node
        )
        return finish([handle], async_op, then=lambda: tensor.copy_(wire))
    if algorithm == "ring":
        torch_reduce_op(op)  # the same error as the native path for an unknown name
        ring_all_reduce(tensor, op, group=group, tag=tag)
        return finish([], async_op)
    if algorithm == "hierarchical":
        work = hierarchy.launch(tensor, op, group, ranks_per_node)
    else:
        work = dist.all_reduce(tensor, op=torch_reduce_op(op), group=group, async_op=True)
    LEDGER.record("all_reduce", tag, nbytes_of(tensor))
    return finish([work], async_op, op="all_reduce", tag=tag, nbytes=nbytes_of(tensor), group=group)


def reduce(
    tensor: Tensor,
    dst: int = 0,
    op: ReduceOpName = "sum",
    *,
    group: Any = None,
    async_op: bool = False,
    tag: str = "",
    dtype: torch.dtype | None = None,
) -> Handle | None:
    """Reduce ``tensor`` from every rank into global rank ``dst``'s ``tensor`` (the others' is left undefined),
    communicated in ``dtype`` when given (a copy, cast back into ``dst``'s ``tensor`` on completion)."""
    wire = _in_dtype(tensor, dtype)
    if wire is not None:
        handle = reduce(wire, dst, op, group=group, async_op=True, tag=tag)
        return finish([handle], async_op, then=(lambda: tensor.copy_(wire)) if rank() == dst else None)
    reduce_op = torch_reduce_op(op)
    LEDGER.record("reduce", tag, nbytes_of(tensor))
    work = dist.reduce(tensor, dst=dst, op=reduce_op, group=group, async_op=True)
    return finish([work], async_op, op="reduce", tag=tag, nbytes=nbytes_of(tensor), group=group)


def broadcast(
    tensor: Tensor, src: int = 0, *, group: Any = None, async_op: bool = False, tag: str = ""
) -> Handle | None:
    """In-place broadcast of ``tensor`` from global rank ``src``."""
    LEDGER.record("broadcast", tag, nbytes_of(tensor))
    work = dist.broadcast(tensor, src=src, group=group, async_op=True)
    return finish([work], async_op, op="broadcast", tag=tag, nbytes=nbytes_of(tensor), group=group)


def reduce_scatter(
    output: Tensor,
    input: Tensor,
    op: ReduceOpName = "sum",
    *,
    group: Any = None,
    async_op: bool = False,
    tag: str = "",
    dtype: torch.dtype | None = None,
) -> Handle | None:
    """Reduce ``input`` (``world_size`` equal chunks, flat) across ranks; this rank's chunk lands in ``output``.

    With ``dtype`` the reduction is communicated in that dtype (copies of ``input`` and ``output``), and the result
    is cast into ``output`` on completion. ``input`` must not change until the handle is waited on (see
    [Note: gloo substitutes]).
    """
    wire = _in_dtype(input, dtype)
    if wire is not None:
        wire_out = output.new_empty(output.shape, dtype=dtype)
        handle = reduce_scatter(wire_out, wire, op, group=group, async_op=True, tag=tag)
        return finish([handle], async_op, then=lambda: output.copy_(wire_out))
    n = world_size(group)
    if input.numel() != output.numel() * n:
        raise ValueError(
            f"reduce_scatter input has {input.numel()} elements: expected world_size={n} x output {output.numel()}"
        )
    LEDGER.record("reduce_scatter", tag, nbytes_of(input))
    if n == 1:  # nothing to exchange (and the pairwise substitute has no peer)
        torch_reduce_op(op)  # validates the name
        output.view(-1).copy_(input.view(-1))
        return finish([], async_op)
    described = {"op": "reduce_scatter", "tag": tag, "nbytes": nbytes_of(input), "group": group}
    if not uses_gloo_substitutes(nbytes_of(input), group):
        work = _reduce_scatter_native(output, input, op=torch_reduce_op(op), group=group, async_op=True)
        return finish([work], async_op, **described)
    if op not in LOCAL_REDUCE:
        raise ValueError(f"reduce_scatter op {op!r} is invalid on gloo: expected one of {sorted(LOCAL_REDUCE)}")
    me, k, out = rank(group), output.numel(), output.view(-1)
    chunks = input.view(-1).split(k)
    peers = [peer for peer in range(n) if peer != me]
    # The first peer's chunk lands in ``output`` itself; the others in buffers of their own.
    received = {peer: out if peer == peers[0] else torch.empty_like(out) for peer in peers}
    works = []
    piece = max(1, GLOO_PIECE_BYTES // out.element_size())  # [Note: gloo pieces]
    for peer, buffer in received.items():
        global_peer = peer if group is None else dist.get_global_rank(group, peer)
        for sent, landing in zip(chunks[peer].split(piece), buffer.split(piece)):
            works.append(dist.isend(sent, global_peer, group=group))
            works.append(dist.irecv(landing, global_peer, group=group))

    def combine() -> None:  # output + every other contribution, in rank order
        for r in range(n):
            if r != peers[0]:
                LOCAL_REDUCE[op](out, chunks[me] if r == me else received[r])
        if op in ("avg", "mean"):
            out.div_(n)

    return finish(works, async_op, then=combine, **described)


def all_gather(
    output: Tensor,
    input: Tensor,
    *,
    group: Any = None,
    async_op: bool = False,
    tag: str = "",
    dtype: torch.dtype | None = None,
) -> Handle | None:
    """Gather every rank's ``input`` into the flat ``output`` (rank ``r``'s chunk at ``[r*k, (r+1)*k)``).

    ``input`` is cast to ``dtype`` (default: ``output``'s) to be communicated; an ``output`` of another dtype is
    filled from a copy on completion (e.g. bf16 on the wire, fp32 parameters).
    """
    if dtype is not None and dtype != output.dtype:
        wire_out = output.new_empty(output.shape, dtype=dtype)
        handle = all_gather(wire_out, input, group=group, async_op=True, tag=tag)
        return finish([handle], async_op, then=lambda: output.copy_(wire_out))
    if input.dtype != output.dtype:
        input = input.to(output.dtype)
    n = world_size(group)
    k = input.numel()
    if output.numel() != k * n:
        raise ValueError(f"all_gather output has {output.numel()} elements: expected world_size={n} x input {k}")
    LEDGER.record("all_gather", tag, nbytes_of(output))
    if n == 1:
        if output.data_ptr() != input.data_ptr():
            output.view(-1).copy_(input.view(-1))
        return finish([], async_op)
    described = {"op": "all_gather", "tag": tag, "nbytes": nbytes_of(output), "group": group}
    if not uses_gloo_substitutes(nbytes_of(output), group):
        work = _all_gather_native(output, input, group=group, async_op=True)
        return finish([work], async_op, **described)
    flat, me = output.view(-1), rank(group)
    mine = flat.narrow(0, me * k, k)
    if mine.data_ptr() != input.data_ptr():  # ZeRO gathers in place: the input already is this rank's slot
        mine.copy_(input.view(-1))
    works, piece = [], max(1, GLOO_PIECE_BYTES // flat.element_size())  # [Note: gloo pieces]
    for q, peer in ((q, global_rank(q, group)) for q in range(n) if q != me):  # each send beside its receive
        for sent, landing in zip(mine.split(piece), flat.narrow(0, q * k, k).split(piece)):
            works += [dist.isend(sent, peer, group=group), dist.irecv(landing, peer, group=group)]
    return finish(works, async_op, **described)


Pieces = Tensor | Sequence[Tensor]
"""What :func:`all_to_all` exchanges with one peer: a tensor, or several (each a message of its own)."""


def all_to_all(
    outputs: Sequence[Pieces], inputs: Sequence[Pieces], *, group: Any = None, async_op: bool = False, tag: str = ""
) -> Handle | None:
    """Send ``inputs[q]`` to group rank ``q`` and receive group rank ``q``'s pieces into ``outputs[q]``, for every
    ``q`` (this rank's own are copied). Each entry is a tensor or a list of tensors; sizes may differ from rank to
    rank, but ``inputs[q]`` here must match ``outputs[me]`` on rank ``q`` piece by piece. Every piece must be
    contiguous; ``inputs`` must stay untouched until the handle has been waited on. The ledger records what this rank
    receives, as for an all-gather: the bytes of ``outputs``.

    gloo's own ``all_to_all`` needs one piece of one size per peer, so on gloo each peer pair exchanges its pieces
    point to point, all in flight at once (pieces of 0 elements are not sent); NCCL uses ``dist.all_to_all`` for
    single pieces and batched point-to-point operations otherwise. Concurrent calls on one group must be started in
    the same order on every rank.
    """
    n, me = world_size(group), rank(group)
    if len(outputs) != n or len(inputs) != n:
        raise ValueError(f"all_to_all got {len(inputs)} inputs and {len(outputs)} outputs: expected {n} of each")
    outs = [[t] if isinstance(t, Tensor) else list(t) for t in outputs]
    ins = [[t] if isinstance(t, Tensor) else list(t) for t in inputs]
    LEDGER.record("all_to_all", tag, sum(nbytes_of(t) for pieces in outs for t in pieces))
    for out, piece in zip(outs[me], ins[me]):
        if out.data_ptr() != piece.data_ptr():
            out.copy_(piece)
    if n == 1:
        return finish([], async_op)
    described = {"op": "all_to_all", "tag": tag, "nbytes": sum(nbytes_of(t) for p in outs for t in p), "group": group}
    if dist.get_backend(group) != "gloo" and all(len(p) == 1 for p in outs + ins):
        work = dist.all_to_all([p[0] for p in outs], [p[0] for p in ins], group=group, async_op=True)
        return finish([work], async_op, **described)
    ops = []
    for peer in (q for q in range(n) if q != me):
        ops += [dist.P2POp(dist.isend, t, global_rank(peer, group), group) for t in ins[peer] if t.numel()]
        ops += [dist.P2POp(dist.irecv, t, global_rank(peer, group), group) for t in outs[peer] if t.numel()]
    if dist.get_backend(group) != "gloo":
        return finish(dist.batch_isend_irecv(ops) if ops else [], async_op, **described)
    return finish([op.op(op.tensor, op.peer, group=op.group) for op in ops], async_op, **described)


def send(tensor: Tensor, dst: int, *, group: Any = None, tag: str = "") -> Handle:
    """Start sending ``tensor`` to global rank ``dst`` (point to point); ``tensor`` must stay untouched until the
    returned handle has been waited on. The ledger records ``("send", tag, bytes)``."""
    LEDGER.record("send", tag, nbytes_of(tensor))
    works = [dist.isend(tensor, dst, group=group)]
    return finish(works, True, op="send", tag=tag, nbytes=nbytes_of(tensor), group=group)  # type: ignore[return-value]


def recv(tensor: Tensor, src: int, *, group: Any = None, tag: str = "") -> Handle:
    """Start receiving into ``tensor`` from global rank ``src``; it holds the data once the handle has been waited
    on. The ledger records ``("recv", tag, bytes)``."""
    LEDGER.record("recv", tag, nbytes_of(tensor))
    works = [dist.irecv(tensor, src, group=group)]
    return finish(works, True, op="recv", tag=tag, nbytes=nbytes_of(tensor), group=group)  # type: ignore[return-value]


def gather_object(obj: Any, dst: int = 0, *, group: Any = None, tag: str = "") -> list[Any] | None:
    """Gather a picklable object from every rank: global rank ``dst`` returns the list in rank order, the others
    ``None``."""
    LEDGER.record("gather_object", tag, len(pickle.dumps(obj)))
    out = [None] * world_size(group) if rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def all_gather_stack(tensor: Tensor, *, group: Any = None, sync_grads: bool = False, tag: str = "") -> Tensor:
    """Gather ``tensor`` from every rank into a new ``(world_size, *tensor.shape)`` tensor.

    With ``sync_grads=True`` the result is differentiable (gradients flow back to each rank's input).
    """
    LEDGER.record("all_gather", tag, nbytes_of(tensor) * world_size(group))
    if sync_grads:
        from torch.distributed.nn.functional import all_gather as differentiable_all_gather

        return torch.stack(differentiable_all_gather(tensor, group=group))
    tensor = tensor.contiguous()
    gathered = [torch.empty_like(tensor) for _ in range(world_size(group))]
    dist.all_gather(gathered, tensor, group=group)
    return torch.stack(gathered)


def broadcast_object(obj: Any, src: int = 0, *, group: Any = None, tag: str = "") -> Any:
    """Broadcast a picklable object from ``src``; every rank returns rank ``src``'s object."""
    LEDGER.record("broadcast_object", tag, len(pickle.dumps(obj)) if rank(group) == src else 0)
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier(*, group: Any = None, device_ids: list[int] | None = None, tag: str = "") -> None:
    LEDGER.record("barrier", tag, 0)
    if device_ids is not None and dist.get_backend(group) == "nccl":
        dist.barrier(group=group, device_ids=device_ids)
    else:
        dist.barrier(group=group)
