"""Tensor-parallel slices as DTensors, for sharded checkpoints through ``torch.distributed.checkpoint`` (DCP).

[Note: tensor-parallel DTensors] A sharded entry of a parallelized module (:func:`sharded_entries`: a weight, a bias,
or an optimizer state tensor of the same shape) is saved as a ``DTensor`` over a 1-D ``DeviceMesh`` of its layer's
tensor-parallel group, placement ``Shard(dim)``: DCP records the full tensor's shape and each rank's piece of it, so a
run at another tensor-parallel size reads its own slices from the same files (DCP reshards). A fused entry
(``chunks=c > 1``, the q/k/v projection) is not one contiguous slice per rank but one per block
(``lightning_zero/tensor_parallel/sharding.py``): its split dimension is viewed as ``(c, n)`` and sharded along ``n``,
so the checkpoint holds it at shape ``(c, n, ...)`` instead of ``(c * n, ...)`` (same elements, same order).
Replicated entries stay plain tensors, identical on every rank, which DCP writes once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_zero.tensor_parallel.layers import TensorParallelModule


def _split(shape: torch.Size, dim: int, chunks: int) -> tuple[list[int], int]:
    """``shape`` with dimension ``dim`` viewed as ``(chunks, n)`` when ``chunks > 1``, and the dimension to shard."""
    if chunks == 1:
        return list(shape), dim
    return [*shape[:dim], chunks, shape[dim] // chunks, *shape[dim + 1 :]], dim + 1


def _mesh(layer: TensorParallelModule, device: torch.device) -> DeviceMesh:
    return DeviceMesh.from_group(layer.group or dist.group.WORLD, device.type)


def to_dtensor(local: Tensor, layer: TensorParallelModule, dim: int) -> DTensor:
    """This rank's slice ``local`` (split along ``dim`` by ``layer``) as a DTensor of the full entry (a view, no
    communication; [Note: tensor-parallel DTensors])."""
    shape, shard_dim = _split(local.shape, dim, layer.chunks)
    full = list(shape)
    full[shard_dim] *= layer.tp_size
    view = local.detach().reshape(shape)
    stride = torch.empty(full, device="meta").stride()
    return DTensor.from_local(
        view, _mesh(layer, local.device), [Shard(shard_dim)], run_check=False, shape=torch.Size(full), stride=stride
    )


def checkpoint_shape(local: Tensor, layer: TensorParallelModule, dim: int) -> tuple[int, ...]:
    """The shape the checkpoint holds the entry of slice ``local`` at ([Note: tensor-parallel DTensors])."""
    shape, shard_dim = _split(local.shape, dim, layer.chunks)
    shape[shard_dim] *= layer.tp_size
    return tuple(shape)


def template(like: Tensor, layer: TensorParallelModule, dim: int, dtype: torch.dtype | None = None) -> DTensor:
    """An empty DTensor for DCP to load the slice of ``like``'s shape into."""
    return to_dtensor(torch.empty(like.shape, dtype=dtype or like.dtype, device=like.device), layer, dim)
