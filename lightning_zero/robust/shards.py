"""Column shards of the workers' vectors: which columns a rank aggregates, in which round, and the sums across shards.

Runbook::

    column_ranges(10, 3)                   # {0: (0, 4), 1: (4, 8), 2: (8, 10)}: ZeRO's partition, clipped to d
    round_shards(rank=1, world_size=3, replicas=2)   # [1, 0]: shard 1 in round 0, shard 0 in round 1
    aggregating_ranks(shard=2, world_size=3, replicas=2)  # [2, 0]
    layout = ColumnLayout.contiguous(10, 3)          # or ColumnLayout.of_groups(numels, groups, 3) under ZeRO
    shard = ColumnShard(1, layout.shards[1], 10, total=sum_over_shards)
    result = aggregator(shard.take(stack), shard)    # the aggregate's columns [4, 8)

[Note: sharded aggregation] With ``sharded_aggregation=True`` rank r of N holds columns ``[start_r, end_r)`` of every
worker's vector (:func:`column_ranges`: ZeRO's flat partition, ``ceil(d / N)`` columns per rank, the last shards
shorter or empty), received by one all-to-all, instead of all ``n x d`` values by an all-gather. Every step of the
robust pipeline is coordinate-wise except sums over all coordinates, and those are sums of per-shard partial sums:
each rank computes its columns' partial sums, and :attr:`ColumnShard.total` all-gathers the N partials and adds
them in shard order, so that every rank holds the same totals bit for bit. What needs totals:

- the non-finite filter (a row's count of non-finite values), the ``robust/honest_distance`` metric (one scalar);
- Krum, Multi-Krum, Bulyan, NNM: the ``(n, n)`` squared distances, once per call;
- geometric median and centered clipping: the ``n`` row norms, once per iteration; ``clip``: the ``n`` row norms.

The rest (mean, median, trimmed mean, Bulyan's coordinate-wise stage, bucketing with its shared generator, the
attacks) works on the columns it is given; ``gaussian`` draws the whole vectors on every rank and keeps its columns.
The result is the aggregate's columns as the unsharded pipeline computes them, up to the order of float sums. Under
robust ZeRO a rank's columns are its optimizer shard's (:meth:`ColumnLayout.of_groups`: with several param groups,
several ranges), so the aggregated shard is that shard's gradient as it is.

[Note: replicated aggregation] With ``aggregation_replicas=r > 1`` each shard is aggregated by ``r`` ranks
(:func:`aggregating_ranks`) in ``r`` rounds: in round ``j`` rank ``q`` aggregates shard ``(q - j) mod N``
(:func:`round_shards`), so that every round covers each shard exactly once and has totals of its own: a rank that
corrupts its partial sums in one round spoils that round's results only, which the other rounds then contradict.
Each round starts from the same generator state, so all rounds draw alike. The ranks then all-gather a digest
(BLAKE2b) of every shard result they computed and compare the ``r`` digests of each shard; a mismatch raises on every
rank, naming the shard and which ranks gave which digest, before anyone applies the step. After the aggregate is
all-gathered from round 0's ranks, every rank checks the digest of each shard it received against the agreed one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_zero.robust.stack import Total, whole
from lightning_zero.zero.partition import flat_layout, shard_ranges


def column_ranges(width: int, world_size: int) -> dict[int, tuple[int, int]]:
    """``{rank: (start, end)}``: ZeRO's partition of ``width`` columns (:func:`~lightning_zero.zero.partition.
    shard_ranges`) clipped to ``width``, so the last shards hold fewer columns, or none."""
    return {r: (min(lo, width), min(hi, width)) for r, (lo, hi) in shard_ranges(width, world_size).items()}


def check_replicas(replicas: object, world_size: int | None = None) -> None:
    """``aggregation_replicas`` is an integer in ``[1, world_size]`` (``None``: the world size is not known yet)."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"aggregation_replicas={replicas!r} is invalid: expected an integer >= 1")
    if world_size is not None and replicas > world_size:
        raise ValueError(
            f"aggregation_replicas={replicas} is invalid for {world_size} processes: each shard is aggregated by that"
            f" many distinct ranks, so expected an integer in [1, {world_size}]"
        )


def round_shards(rank: int, world_size: int, replicas: int) -> list[int]:
    """The shard ``rank`` aggregates in each round ``j = 0 .. replicas - 1``: ``(rank - j) mod world_size``."""
    return [(rank - j) % world_size for j in range(replicas)]


def aggregating_ranks(shard: int, world_size: int, replicas: int) -> list[int]:
    """The ranks that aggregate ``shard``, by round: ``(shard + j) mod world_size``."""
    return [(shard + j) % world_size for j in range(replicas)]


def _coalesce(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if lo == hi:
            continue
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


@dataclass(frozen=True)
class ColumnLayout:
    """Which columns of the ``width``-wide worker vectors each rank's shard holds: ``shards[r]``, ``(start, end)``
    ranges in the order the shard lays out its values (for ZeRO, its optimizer shard's order)."""

    width: int
    shards: tuple[tuple[tuple[int, int], ...], ...]

    @classmethod
    def contiguous(cls, width: int, world_size: int) -> ColumnLayout:
        """One range per rank: :func:`column_ranges`."""
        return cls(width, tuple(_coalesce([r]) for r in column_ranges(width, world_size).values()))

    @classmethod
    def of_groups(cls, numels: Sequence[int], groups: Sequence[Sequence[int]], world_size: int) -> ColumnLayout:
        """The shards of ZeRO's flat groups ([Note: flat layout] in ``lightning_zero/zero/partition.py``) over vectors
        whose columns hold parameters of ``numels`` in that order: ``groups`` lists each flat group's parameters by
        index, in the group's order; rank ``r``'s shard is its range of every group, group after group."""
        offsets = [sum(numels[:i]) for i in range(len(numels))]
        shards = []
        for rank in range(world_size):
            ranges = []
            for group in groups:
                layout = flat_layout([numels[i] for i in group], world_size)
                for i, in_param, _, length in layout.param_pieces(rank):
                    lo = offsets[group[i]] + in_param
                    ranges.append((lo, lo + length))
            shards.append(_coalesce(ranges))
        return cls(sum(numels), tuple(shards))

    @property
    def world_size(self) -> int:
        return len(self.shards)

    def size(self, rank: int) -> int:
        """The columns of ``rank``'s shard."""
        return sum(hi - lo for lo, hi in self.shards[rank])

    @property
    def is_contiguous(self) -> bool:
        """Whether the shards are :meth:`contiguous`'s: their padded all-gather is the vector itself."""
        return self == ColumnLayout.contiguous(self.width, self.world_size)

    def take(self, vector: Tensor, rank: int) -> Tensor:
        """``rank``'s columns of ``vector`` (``(..., width)``), in the shard's order."""
        pieces = [vector[..., lo:hi] for lo, hi in self.shards[rank]]
        if len(pieces) == 1:
            return pieces[0]  # a view
        return torch.cat(pieces, dim=-1) if pieces else vector[..., :0]

    def put(self, vector: Tensor, rank: int, values: Tensor) -> None:
        """Write ``values`` (``rank``'s columns, in the shard's order) into ``vector``, in place."""
        offset = 0
        for lo, hi in self.shards[rank]:
            vector[..., lo:hi] = values[..., offset : offset + hi - lo]
            offset += hi - lo


@dataclass(frozen=True)
class ColumnShard:
    """The columns ``ranges`` of ``width``-wide worker vectors (shard ``index`` of a :class:`ColumnLayout`), and how
    partial sums over them become totals."""

    index: int
    ranges: tuple[tuple[int, int], ...]
    width: int
    total: Total = field(default=whole, compare=False)

    @classmethod
    def whole(cls, width: int) -> ColumnShard:
        """Every column: the unsharded pipeline."""
        return cls(0, ((0, width),), width)

    def take(self, vector: Tensor) -> Tensor:
        """This shard's columns of ``vector`` (``(..., width)``)."""
        return ColumnLayout(self.width, (self.ranges,)).take(vector, 0)

    def put(self, vector: Tensor, values: Tensor) -> None:
        """Write this shard's ``values`` into ``vector`` (``(..., width)``), in place."""
        ColumnLayout(self.width, (self.ranges,)).put(vector, 0, values)
