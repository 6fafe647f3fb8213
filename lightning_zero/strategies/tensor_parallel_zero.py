"""ZeRO over the data-parallel dimension of ``tensor_parallel_scratch``: the engines built over the parallelized
module (:func:`shard_params`, :func:`shard_optimizer`) and the gradient norms of their shards (:func:`shard_norms`).

[Note: ZeRO x tensor parallel] ``zero_stage`` 1 or 2 puts the ZeRO-1/2 engine of :mod:`lightning_zero.zero.stage12`
(:class:`~lightning_zero.zero.stage12.ShardedOptimizer`) in the reducer's place, built after ``configure_optimizers``
over the *parallelized* module with the data-parallel group ``(*, i)`` as its shard group. The tensor roles of rank
``(r, i)``, Ψ_i the elements of slice ``i`` (its tensor-parallel slices plus every replicated parameter):

- *tensor-parallel slice*: a module parameter in slice ``i``'s local shape, now a view into a *flat param* of the
  engine (one padded buffer per optimizer param group, 4Ψ_i bytes, equal on the ranks of the data group), which the
  all-gather after each step refreshes. The replicated parameters lie in the same flat buffers.
- *ZeRO shard* of the flat param: replica ``r``'s ``1 / replicas`` of it, the only tensor the optimizer steps, so the
  optimizer state (AdamW's two moments) costs 8Ψ_i / replicas per rank instead of 8Ψ_i.
- *gradient storage*: stage 1 keeps a full flat gradient (4Ψ_i) and communicates only at the accumulation boundary
  (``grad_sync="boundary"``); stage 2 reduces every micro-batch and keeps only the shard's gradient (4Ψ_i / replicas)
  plus two buckets' pool ([Note: tensor roles] in ``lightning_zero/zero/flat_group.py``).

``zero_stage=3`` shards the slices themselves: the ZeRO-3 engine of :mod:`lightning_zero.zero.stage3.engine`
(:class:`~lightning_zero.zero.stage3.engine.ShardedParams`) is built over the parallelized module with the data group
as its shard group, before the optimizer. A *module parameter* of rank ``(r, i)`` is then a placeholder of slice
``i``'s local shape; before a unit's forward (and again before its backward) the engine all-gathers its *ZeRO shards*
over the data group ``(*, i)`` into the *unsharded flat*, so the tensor-parallel layer computes with its whole slice,
and the slice's gradients are reduce-scattered into each replica's shard: parameters, gradients and optimizer state of
the slice cost 1 / replicas each (4Ψ_i + 4Ψ_i + 8Ψ_i over replicas). Its gather-sequence check needs a gloo group per
data group, created on every rank (``new_data_groups``), as ``torch.distributed.new_group`` requires.

Nothing crosses the tensor-parallel group but the activations, the loss and the norm: ZeRO's reductions and
all-gathers run over the data group only, and a slice's flat layout is the same on every rank holding it. Checkpoints
gather each state tensor over the data group first (to replica 0) and then over the tensor-parallel group, so the file
is the same as with ``zero_stage=0``. With one replica there is nothing to shard and ``zero_stage`` changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.training.mesh import MeshGroups, new_data_groups
from lightning_zero.training.precision import PrecisionPolicy
from lightning_zero.zero.grad_norm import shard_grad_norms
from lightning_zero.zero.hybrid import ShardingGroups
from lightning_zero.zero.settings import ZeroSettings, build_stage3, build_stage12
from lightning_zero.zero.stage3.engine import ShardedParams
from lightning_zero.zero.stage12 import ShardedOptimizer


def shard_params(
    zero: ZeroSettings, module: nn.Module, groups: MeshGroups, device: torch.device, timeout: timedelta | None
) -> ShardedParams:
    """ZeRO-3 over the data-parallel group: the parallelized module's parameters (this rank's slices and the
    replicated ones) sharded per unit, before the optimizer is built over them."""
    # The gather-sequence check's gloo groups: every rank creates every slice's ([Note: gather sequence check]).
    check = new_data_groups(groups.mesh, groups.index, backend="gloo", timeout=timeout)
    return build_stage3(
        zero,
        PrecisionPolicy(),
        module,
        device=device,
        timeout=timeout,
        find_unused_parameters=False,
        groups=ShardingGroups(shard=groups.data_group, check=check),
    )


def shard_optimizer(
    zero: ZeroSettings,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    engine: ShardedOptimizer | ShardedParams | None,
    groups: MeshGroups,
) -> ShardedOptimizer | ShardedParams:
    """The optimizer sharded over the data-parallel group, over the parallelized module: its flat groups hold this
    rank's tensor-parallel slices (ZeRO-3: attached to :func:`shard_params`' ``engine``)."""
    if len(optimizers) != 1:
        raise ValueError(
            f"zero_stage={zero.stage} shards one optimizer over the data-parallel group: configure_optimizers"
            f" returned {len(optimizers)}; combine them into one optimizer with several param groups"
        )
    if isinstance(engine, ShardedParams):
        engine.attach_optimizer(optimizers[0])
        return engine
    # The module's own dtypes throughout (no master copies, reductions in the gradients' dtype), as zero_stage=0.
    return build_stage12(
        zero,
        PrecisionPolicy(),
        module,
        optimizers[0],
        find_unused_parameters=False,
        groups=ShardingGroups(shard=groups.data_group),
    )


def shard_norms(
    engine: ShardedOptimizer | ShardedParams, sliced: set[str], device: torch.device
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """The norms of the parameters' averaged gradients under ZeRO, the tensor-parallel slices' (the parameter names
    ``sliced``) and the replicated ones', each summed from its pieces in every shard of the data-parallel group (one
    all-reduce; [Note: global norm] in ``lightning_zero/tensor_parallel/grad_norm.py``), and the shard gradients."""
    pieces = [p for p in engine.param_pieces if p.shard.grad is not None]
    norms = shard_grad_norms(pieces, 2.0, group=engine.group, device=device)
    sharded = [norm for p, norm in zip(pieces, norms) if p.name in sliced]
    replicated = [norm for p, norm in zip(pieces, norms) if p.name not in sliced]
    return sharded, replicated, [p.grad for p in engine.shard_params if p.grad is not None]
