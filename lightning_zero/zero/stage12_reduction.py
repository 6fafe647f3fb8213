"""ZeRO-1/2's gradient reduction: the buckets over the flat groups, how each is averaged, and where its reduced values
go. The engine (:class:`~lightning_zero.zero.stage12.ShardedOptimizer`) builds one :class:`ShardGradients` and keeps
the :class:`~lightning_zero.dp.reducer.GradientReducer` it makes; the reducer calls back into it as buckets complete.

[Note: gradient reduction] A gradient bucket is a contiguous range ``[lo, hi)`` of a flat group; each rank needs only
the part inside its shard. ``grad_reduction`` chooses how the bucket is averaged:
- ``"all_reduce"``: every rank receives the whole averaged bucket and keeps its part. A ring all-reduce moves
  2(N-1)/N of the bucket per rank, so with the parameter all-gather after the step ((N-1)/N) a step moves 3(N-1)/N
  x 4Ψ per rank, 1.5x DDP's 2(N-1)/N x 4Ψ.
- ``"reduce_scatter"`` (DeepSpeed's ``reduce_scatter``): the bucket is cut where shards end, and each piece is reduced
  (summed) into the rank that owns it and divided there, so every rank receives only its shard of the gradient, and a
  step moves about as much as DDP's. Only for transient buckets (stage 2, or stage 1 with ``"microbatch"``): stage 1's
  ``"boundary"`` mode keeps the full averaged gradient (``p.grad``) on every rank. Under hybrid sharding the pieces
  are reduced in the shard group, then each owned piece is all-reduced across the replicas. How the pieces travel:
  [Note: reduce to owners] in ``lightning_zero/comm/owners.py``.
- ``"auto"``: ``"reduce_scatter"`` where the buckets are transient, else ``"all_reduce"``, on every backend. Under
  the link model ([Note: link model] in ``lightning_zero/comm/link_model.py``) a bucket of B bytes over n ranks costs
  (n-1)·α + (n-1)/n·B·β reduced to its owners against 2(n-1)·α + 2(n-1)/n·B·β all-reduced: half, whatever the link,
  so the choice needs no model of it. That halves the bytes; the time halves only where a bucket's pieces cross a
  link both ways at once. The shards are contiguous ranges of the flat and buckets fill in reverse, so at N = 2 most
  buckets have one owner: their bytes go one way, the first half of backward's from rank 0 to 1, the second half
  back, and the exchange takes about as long as the all-reduce's. Measured with gloo (gpt25m, ZeRO-2,
  docs/benchmarks.md): 0.998x the all-reduce mode's step over loopback, 0.955x on the network lab at 1 Gbit/s, and
  0.865-0.932x on 4 ranks of the lab (small GPT).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.comm import collectives as comm
from lightning_zero.comm.bucketing import assign_buckets
from lightning_zero.comm.owners import reduce_to_owners
from lightning_zero.dp.buckets import GradBucket
from lightning_zero.dp.reducer import GradientReducer
from lightning_zero.zero.flat_group import FlatGroup
from lightning_zero.zero.optimizer_checks import check_grad_reduction


def resolve_grad_reduction(grad_reduction: str, stage: int, grad_sync: str, persistent: bool) -> str:
    """``grad_reduction`` checked against the gradient storage (``persistent``: stage 1's full flat gradient), with
    ``"auto"`` resolved ([Note: gradient reduction])."""
    check_grad_reduction(grad_reduction, stage, grad_sync)
    if grad_reduction != "auto":
        return grad_reduction
    return "all_reduce" if persistent else "reduce_scatter"


def group_buckets(
    module: nn.Module, groups: list[FlatGroup], bucket_cap_bytes: int, persistent: bool
) -> tuple[list[tuple[str, nn.Parameter, FlatGroup, int]], list[GradBucket], dict[int, tuple[FlatGroup, int, int]]]:
    """The gradient buckets over ``groups``' flat parameters, capped at ``bucket_cap_bytes`` and never spanning two
    groups: ``(entries, buckets, bucket_range)``, with ``entries`` every trainable parameter as ``(name, param, group,
    flat offset)`` in reverse registration order (the order gradients arrive in) and ``bucket_range[id(bucket)]`` its
    ``(group, lo, hi)`` range of the flat. A persistent bucket (stage 1, ``"boundary"``) is a view of its group's full
    flat gradient, made here on first use."""
    # Every trainable parameter in reverse registration order, tagged with its group and flat offset.
    entries = []
    where = {id(p): (g, offset) for g in groups for p, offset in zip(g.params, g.layout.offsets)}
    for name, p in reversed(list(module.named_parameters())):
        if id(p) in where:
            entries.append((name, p, *where[id(p)]))
    layouts = assign_buckets(
        [p.numel() for _, p, _, _ in entries],
        [torch.empty((), dtype=g.grad_dtype).element_size() for _, _, g, _ in entries],
        [g.key for _, _, g, _ in entries],
        bucket_cap_bytes,
    )
    buckets: list[GradBucket] = []
    bucket_range: dict[int, tuple[FlatGroup, int, int]] = {}
    by_key: dict[Hashable, FlatGroup] = {g.key: g for g in groups}  # a bucket's key is its group's
    for layout in layouts:
        g = by_key[layout.key]
        members = [entries[i] for i in layout.indices]
        lo = min(offset for *_, offset in members)
        hi = max(offset + p.numel() for _, p, _, offset in members)
        if hi == g.layout.numel:
            hi = g.layout.padded_numel  # the bucket holding the group's end carries the padding
        offsets = tuple(offset - lo for *_, offset in members)
        bucket = GradBucket(layout.indices, offsets, hi - lo, g.grad_dtype, g.flat.device)
        if persistent:
            if g.flat_grad is None:
                g.flat_grad = torch.zeros_like(g.flat, dtype=g.grad_dtype)
            bucket.buffer = g.flat_grad.narrow(0, lo, hi - lo)
        bucket_range[id(bucket)] = (g, lo, hi)
        buckets.append(bucket)
    return entries, buckets, bucket_range


class ShardGradients:
    """The gradient reduction of a ZeRO-1/2 engine's flat ``groups``: :meth:`reducer` makes the buckets and the
    reducer over them; each reduced bucket's owned slice lands in the shard's gradient storage (:meth:`on_reduced`).

    ``persistent``: stage 1's ``"boundary"`` storage (the full flat gradient), else transient buckets reduced into a
    shard accumulator. ``group``: the shard group; ``replicate_group``: hybrid sharding's replicas (``None``: none).
    ``grad_reduction``: ``"all_reduce"`` or ``"reduce_scatter"``, resolved ([Note: gradient reduction]).
    """

    def __init__(
        self,
        groups: list[FlatGroup],
        *,
        persistent: bool,
        grad_reduction: str,
        reduce_dtype: torch.dtype | None,
        group: dist.ProcessGroup | None,
        replicate_group: dist.ProcessGroup | None,
    ) -> None:
        self.groups, self.persistent, self.grad_reduction = groups, persistent, grad_reduction
        self.reduce_dtype, self.group, self.replicate_group = reduce_dtype, group, replicate_group
        self.world_size, self.rank = comm.world_size(group), comm.rank(group)
        self._bucket_range: dict[int, tuple[FlatGroup, int, int]] = {}

    def reducer(self, module: nn.Module, bucket_cap_bytes: int, find_unused: bool) -> GradientReducer:
        """The buckets over the groups (and, for transient ones, each group's shard accumulator), and the reducer that
        fills and averages them from autograd hooks."""
        entries, buckets, self._bucket_range = group_buckets(module, self.groups, bucket_cap_bytes, self.persistent)
        group_of = {id(p): g for _, p, g, _ in entries}
        if not self.persistent:
            for g in self.groups:
                g.shard_grad = torch.zeros_like(g.shard, dtype=g.grad_dtype)
        return GradientReducer(
            [p for _, p, _, _ in entries],
            [name for name, *_ in entries],
            buckets,
            transient=not self.persistent,
            on_reduced=self.on_reduced,
            find_unused_parameters=find_unused,
            group=self.group if self.replicate_group is None else None,  # hybrid: the average over every rank
            reduce_dtype=self.reduce_dtype,
            reduce_bucket=self.reduce_to_owners if self.grad_reduction == "reduce_scatter" else None,
            ignored=lambda p: not group_of[id(p)].shard.requires_grad,  # [Note: toggled-off optimizers]
        )

    def reduce_to_owners(self, bucket: GradBucket) -> comm.Handle:
        """Launch the average of ``bucket`` into the ranks that own its pieces ([Note: gradient reduction])."""
        g, lo, hi = self._bucket_range[id(bucket)]
        buffer = bucket.buffer
        assert buffer is not None  # the reducer hands over a bucket with its gradients
        pieces = []
        for r in range(self.world_size):
            owned_lo, owned_hi = g.layout.owned(r, lo, hi)
            start = owned_lo - lo if owned_lo < owned_hi else 0  # an empty range may start past the bucket
            pieces.append(buffer.narrow(0, start, owned_hi - owned_lo))
        handle = reduce_to_owners(pieces, group=self.group, tag="grads", dtype=self.reduce_dtype)
        mine = pieces[self.rank]

        def average() -> None:
            if not mine.numel():
                return
            mine.div_(self.world_size)
            if self.replicate_group is not None:  # hybrid: the shard group's average, averaged across the replicas
                comm.all_reduce(mine, "avg", group=self.replicate_group, tag="grads", dtype=self.reduce_dtype)

        return comm.Handle([handle], then=average)

    def on_reduced(self, bucket: GradBucket) -> None:
        """A reduced bucket: this rank's slice into its group's shard gradient (stage 1's ``"boundary"``: a view of
        the full flat gradient, already in place)."""
        g, lo, hi = self._bucket_range[id(bucket)]
        first, g.accumulating = not g.accumulating, True  # first: the first reduction since the last step
        if self.persistent:
            if not g.casts_grad:
                g.shard.grad = g.shard_of_flat_grad()
            return
        shard_grad = g.shard_grad
        assert shard_grad is not None  # transient buckets: made with the reducer
        if g.casts_grad and first:
            shard_grad.zero_()  # the last window's sum went to shard.grad in before_step
        elif not g.casts_grad and g.shard.grad is None:  # zeroed by the optimizer: a new window
            shard_grad.zero_()
            g.shard.grad = shard_grad
        owned_lo, owned_hi = g.layout.owned(self.rank, lo, hi)
        if owned_lo < owned_hi:
            assert bucket.buffer is not None  # the reducer hands over a bucket with its gradients
            shard_grad.narrow(0, owned_lo - g.start, owned_hi - owned_lo).add_(
                bucket.buffer.narrow(0, owned_lo - lo, owned_hi - owned_lo)
            )
