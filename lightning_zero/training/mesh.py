"""A 2-D grid of ranks: ``data`` replicas of a model split ``model_size`` ways (pipeline stages, tensor shards).

Rank ``r`` sits at ``(r // model_size, r % model_size)``: the ``model_size`` ranks of one replica are consecutive (on
one node when ``model_size`` divides the processes per node, where the model-parallel traffic is heaviest), and the
ranks holding the same part of the model (one per replica) form a data-parallel group::

    world 4, model_size 2            model index 0   model index 1
      replica 0 (model group)          rank 0          rank 1
      replica 1 (model group)          rank 2          rank 3
                                    data group {0,2}  data group {1,3}

The layout is pure (:class:`Mesh`); :func:`new_groups` creates the process groups, every rank creating every group in
the same order, as ``torch.distributed.new_group`` requires.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class Mesh:
    """``world_size`` ranks as ``world_size // model_size`` replicas of ``model_size`` ranks each.

    Args:
        world_size: every rank of the job.
        model_size: ranks per replica; it must divide ``world_size``.
        name: what ``model_size`` counts, for error messages (``"stages"``, ``"tensor_parallel_size"``).
    """

    world_size: int
    model_size: int
    name: str = "model_size"

    def __post_init__(self) -> None:
        size = self.model_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1 or self.world_size % size:
            raise ValueError(
                f"{self.name}={size!r} is invalid: expected a divisor of the world size {self.world_size} (the"
                f" {self.world_size} processes form world size / {self.name} data-parallel replicas)"
            )

    @property
    def data_size(self) -> int:
        """Number of replicas."""
        return self.world_size // self.model_size

    def coordinates(self, rank: int) -> tuple[int, int]:
        """``(replica, model index)`` of ``rank``."""
        return divmod(rank, self.model_size)

    def model_group(self, replica: int) -> list[int]:
        """The ranks of ``replica``, by model index."""
        return list(range(replica * self.model_size, (replica + 1) * self.model_size))

    def data_group(self, index: int) -> list[int]:
        """The ranks holding model part ``index``, by replica."""
        return list(range(index, self.world_size, self.model_size))


@dataclass(frozen=True)
class MeshGroups:
    """This rank's place in a :class:`Mesh` and its two process groups (``None``: the group would be the world)."""

    mesh: Mesh
    replica: int
    index: int
    model_ranks: list[int]
    data_ranks: list[int]
    model_group: Any
    data_group: Any


def new_groups(mesh: Mesh, rank: int) -> MeshGroups:
    """Create every model and data group of ``mesh`` (collective: every rank calls it) and return ``rank``'s."""
    replica, index = mesh.coordinates(rank)
    model_group = data_group = None
    if mesh.data_size > 1:  # with one replica the model group is the world: no new group needed
        for r in range(mesh.data_size):
            group = dist.new_group(mesh.model_group(r))
            model_group = group if r == replica else model_group
    if mesh.model_size > 1:
        data_group = new_data_groups(mesh, index)
    return MeshGroups(mesh, replica, index, mesh.model_group(replica), mesh.data_group(index), model_group, data_group)


def new_data_groups(mesh: Mesh, index: int, **options: Any) -> Any:
    """Create every data group of ``mesh`` (collective), with ``torch.distributed.new_group``'s ``options``
    (``backend``, ``timeout``), and return model part ``index``'s."""
    mine = None
    for i in range(mesh.model_size):
        group = dist.new_group(mesh.data_group(i), **options)
        mine = group if i == index else mine
    return mine
