"""Hybrid sharding: shard within groups of ``shard_size`` consecutive ranks, replicate across the groups.

[Note: hybrid sharding] With N ranks and ``shard_size`` G (G divides N), rank r belongs to the *shard group*
``r // G`` (ranks ``[G*(r//G), G*(r//G) + G)``: on a cluster, the ranks of one node) and to the *replicate group*
``r % G`` (the ranks holding the same shard in every shard group: one per node). Every ZeRO state (optimizer
state, gradient shard, parameter shard) is split G ways instead of N, so per-rank model-state memory follows the ZeRO
formulas with N replaced by G, and each shard exists N/G times. Communication:

- stage 3 gathers parameters inside the shard group only (ZeRO++'s hpZ: the bandwidth-hungry all-gathers stay on the
  fast intra-node links), and reduces gradients in two steps: reduce-scatter (average) in the shard group, then an
  all-reduce (average) of the G-times smaller shard across the replicate group. Both are averages over equal-sized
  groups, so the result is the average over all N ranks.
- stages 1 and 2 average the whole gradient over all N ranks in the bucketed all-reduce they use without hybrid
  sharding (``lightning_zero/dp/reducer.py``; each rank then keeps its shard's slice), and all-gather the updated
  shards inside the shard group.

Global quantities that combine shards (gradient-norm clipping, per-parameter gradient norms) reduce over the shard
group only: every shard group holds the same averaged shards, so reducing over all N ranks would count each shard N/G
times. Quantities about the whole job (parameters no rank used, initial weights, the gather-order check) stay on
the default group.

The ranks of each group are a pure function (:func:`hybrid_ranks`, tested without processes); :func:`new_groups`
creates the process groups (collective: every rank creates every group, in the same order, as torch requires).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from lightning_zero.comm import collectives as comm


def check_shard_size(shard_size: Any, world_size: int | None = None) -> None:
    """Raise unless ``shard_size`` is ``None`` (shard over all ranks) or an integer >= 1 that divides
    ``world_size`` (when known)."""
    if shard_size is None:
        return
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"shard_size={shard_size!r} is invalid: expected an integer >= 1 or None (all ranks)")
    if world_size is not None and world_size % shard_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"shard_size={shard_size} does not divide the world size {world_size}: expected one of {divisors}"
            " or None (all ranks)"
        )


def hybrid_ranks(world_size: int, shard_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """``(shard_groups, replicate_groups)``: the global ranks of each, per [Note: hybrid sharding]."""
    check_shard_size(shard_size, world_size)
    shard_groups = [list(range(start, start + shard_size)) for start in range(0, world_size, shard_size)]
    replicate_groups = [list(range(offset, world_size, shard_size)) for offset in range(shard_size)]
    return shard_groups, replicate_groups


@dataclass(frozen=True)
class ShardingGroups:
    """This rank's process groups: ``shard`` (the engine's ``group``) and ``replicate`` (``None``: no replicas)."""

    shard: Any = None
    replicate: Any = None
    shard_size: int | None = None
    check: Any = None
    """ZeRO-3's gather-sequence check group over ``shard``'s ranks (``None``: the engine creates it)."""

    @property
    def hybrid(self) -> bool:
        return self.replicate is not None


def new_groups(shard_size: int | None) -> ShardingGroups:
    """The groups of ``shard_size`` on the default group (collective). ``None``, or the world size: no hybrid
    sharding, the default group for everything."""
    world = comm.world_size()
    check_shard_size(shard_size, world)
    if shard_size is None or shard_size == world:
        return ShardingGroups()
    shard_groups, replicate_groups = hybrid_ranks(world, shard_size)
    me = comm.rank()
    mine: dict[str, Any] = {}
    for kind, groups in (("shard", shard_groups), ("replicate", replicate_groups)):
        for ranks in groups:
            group = dist.new_group(ranks)
            if me in ranks:
                mine[kind] = group
    return ShardingGroups(shard=mine["shard"], replicate=mine["replicate"], shard_size=shard_size)
