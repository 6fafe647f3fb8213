"""Slicing full tensors into tensor-parallel shards and gathering them back.

Rank ``r`` of a group of ``N`` ranks holds slice ``r`` of ``N`` equal slices along one dimension. With ``chunks=c``
that dimension is ``c`` blocks laid end to end (a fused q/k/v projection: ``c=3``), each split into ``N`` slices
separately, and rank ``r`` holds slice ``r`` of every block, in block order ([Note: tensor-parallel slices] in
``lightning_zero/tensor_parallel/layers.py``). :func:`shard` takes this rank's slice of a full tensor without
communicating; :func:`unshard` all-gathers the slices back into the full tensor.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_zero.comm import collectives as comm

STATE_TAG = "tp_state"
"""Ledger tag of the all-gathers of :func:`unshard` (kept apart from the training step's ``"tp"``)."""


def divide(value: int, size: int, what: str, chunks: int = 1) -> int:
    """``value // size`` for a ``value`` that splits into ``chunks`` blocks of ``size`` equal slices each.

    Args:
        value: the full size (features, rows, heads).
        size: the tensor-parallel group size.
        what: the size's name, for the error message.
        chunks: the number of blocks split separately.

    Raises:
        ValueError: ``value`` is not divisible by ``chunks * size`` (or ``chunks < 1``), with the numbers.
    """
    if chunks < 1:
        raise ValueError(f"chunks={chunks} is invalid: expected an integer >= 1")
    if value % (chunks * size):
        by = f"the tensor-parallel size {size}"
        if chunks > 1:
            by = f"chunks={chunks} x {by} = {chunks * size}"
        raise ValueError(f"{what}={value} is not divisible by {by}")
    return value // size


def shard(tensor: Tensor, dim: int, group: Any = None, chunks: int = 1) -> Tensor:
    """This rank's slice of the full ``tensor`` along ``dim`` ([Note: tensor-parallel slices]), as a new tensor.

    Args:
        tensor: the full tensor, equal on every rank of ``group``.
        dim: the dimension to split.
        group: the tensor-parallel process group; ``None`` is the world.
        chunks: ``dim`` holds this many blocks, each split into the group's slices separately.
    """
    n, dim = comm.world_size(group), dim % tensor.ndim
    divide(tensor.shape[dim], n, f"tensor dimension {dim}: size", chunks)
    return tensor.unflatten(dim, (chunks, n, -1)).select(dim + 1, comm.rank(group)).flatten(dim, dim + 1).clone()


def unshard(local: Tensor, dim: int, group: Any = None, chunks: int = 1) -> Tensor:
    """The full tensor from every rank's :func:`shard` of it (an all-gather: every rank of ``group`` calls it).

    Args:
        local: this rank's slice.
        dim: the dimension it was split along.
        group: the tensor-parallel process group; ``None`` is the world.
        chunks: the number of blocks ``dim`` was split in separately.
    """
    n, dim = comm.world_size(group), dim % local.ndim
    flat = local.new_empty(n * local.numel())
    comm.all_gather(flat, local.reshape(-1), group=group, tag=STATE_TAG)  # gloo: flat input for a flat output
    # (N, ..., chunks, piece, ...) -> (..., chunks, N, piece, ...): block j is its N pieces in rank order.
    pieces = flat.view(n, *local.shape).unflatten(dim + 1, (chunks, -1)).movedim(0, dim + 1)
    return pieces.flatten(dim, dim + 2)
