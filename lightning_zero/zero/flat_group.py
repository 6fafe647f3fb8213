"""A ZeRO-1/2 param group flattened into one buffer and sharded (:class:`FlatGroup`), and one optimizer's part of
the engine (:class:`OptimizerShards`), which the state dicts of :mod:`lightning_zero.zero.stage12_state` are made of.
The engine that builds and drives them is :class:`~lightning_zero.zero.stage12.ShardedOptimizer`.

[Note: tensor roles] (see also [Note: flat layout] in ``lightning_zero/zero/partition.py``)
- *flat param*: one padded buffer per param group; every module parameter of the group is a view into it, so the
  all-gather after the step writes the module's parameters directly. 4Ψ bytes (+ padding) on every rank.
- *shard param*: an ``nn.Parameter`` aliasing this rank's slice of the flat param. The user's optimizer object is
  rebuilt *in place* (``group["params"] = [shard]``), so LR schedulers and ``trainer.optimizers[0].param_groups``
  keep working on the same object with the same hyper-parameters; its state (e.g. AdamW's two moments) exists for
  the shard only: 8Ψ/N bytes.
- *shard grad*: ``shard.grad``, this rank's slice of the averaged gradient.
- *master shard* (mixed precision, [Note: precision policy] in ``lightning_zero/training/precision.py``): when the flat
  param is in a low-precision dtype (``cast_dtype``, or ``bf16-true``) or is gathered in one (``gather_dtype``), the
  shard param is an fp32 copy of this rank's slice instead of a view; the optimizer updates it, gradient buckets and
  shard grads are fp32 (accumulation in fp32), and after the step each rank's master is rounded to ``gather_dtype`` and
  all-gathered into the flat param. Its value goes into checkpoints as
  the optimizer state ``"master"`` (the module weights are the rounded copy), as DeepSpeed keeps fp32 partitions.
- *gradient storage in* ``accum_dtype`` (DeepSpeed's ``grad_accum_dtype``): gradient buckets, stage 1's flat gradient
  and stage 2's shard accumulator in a low-precision dtype instead of the master's, so the gradients cost 2 bytes per
  element (the ZeRO paper's accounting: stage 1 4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N with a 2-byte module). The shard
  param's ``.grad`` must have its dtype, so :meth:`ShardedOptimizer.before_step` gives it a copy of the accumulated
  shard gradient in that dtype, which :meth:`ShardedOptimizer.after_step` drops (4Ψ/N in fp32, during the step only).
- *gradient buckets*: contiguous ranges of a flat group, filled in reverse registration order and all-reduced
  (average) from autograd hooks by :class:`~lightning_zero.dp.reducer.GradientReducer` while backward runs.

Gradient storage, by ``stage`` and ``grad_sync``:
- stage 1, ``"boundary"`` (stage 1's default): a persistent full flat gradient per group (4Ψ); ``p.grad`` is a view of
  it, micro-batches accumulate locally without communication, and one reduction per optimizer step leaves every
  rank with the full averaged gradient, of which ``shard.grad`` is a view. Stage 1 memory: 4Ψ + 4Ψ + 8Ψ/N.
- ``"microbatch"`` (stage 2's default; also valid for stage 1): every micro-batch reduces its buckets; each bucket
  borrows one of the reducer's two pool buffers when its first gradient arrives, its owned slice is added to a
  persistent shard accumulator (4Ψ/N) once reduced, and the buffer goes back to the pool, so no full gradient
  survives between micro-batches. Stage 2 memory: 4Ψ + 4Ψ/N + 8Ψ/N, plus the pool (two buckets) reported apart.
- stage 2, ``"boundary"``: micro-batches accumulate into transient buckets (full local gradients, no communication;
  buckets beyond the pool's two are allocated for the window) that are reduced into the shard accumulator and
  released at the boundary, before the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zero.zero.partition import FlatLayout, flat_layout


class FlatGroup:
    """One optimizer param group flattened: its layout, flat param, shard param and gradient storage."""

    def __init__(
        self,
        index: int,
        original_params: list[nn.Parameter],
        params: list[nn.Parameter],
        names: list[str],
        world_size: int,
        rank: int,
        cast_dtype: torch.dtype | None = None,
        gather_dtype: torch.dtype | None = None,
        master_dtype: torch.dtype | None = None,
        accum_dtype: torch.dtype | None = None,
        optimizer_index: int = 0,
        key: int = 0,
    ) -> None:
        if not params:
            raise ValueError(f"param group {index} has no trainable parameters: drop the group or unfreeze some")
        dtypes = {(p.dtype, p.device) for p in params}
        if len(dtypes) > 1:
            raise ValueError(
                f"param group {index} mixes dtypes/devices {sorted(map(str, dtypes))}: ZeRO flattens a group into one"
                " buffer, so split the group by dtype"
            )
        self.index = index  # in its optimizer's param groups
        self.optimizer_index, self.key = optimizer_index, key  # which optimizer; its position among all flat groups
        self.params = params
        self.names = names
        self.layout: FlatLayout = flat_layout([p.numel() for p in params], world_size)
        self.module_dtype = params[0].dtype  # what the module had: it gets the master values back in it
        dtype, device = cast_dtype or self.module_dtype, params[0].device
        self.start, self.end = self.layout.shard_range(rank)
        self.gather_dtype = gather_dtype or dtype
        rounded = dtype != master_dtype or self.gather_dtype != master_dtype  # the flat holds rounded values
        master = master_dtype if master_dtype is not None and rounded else None
        if master is not None:  # from the values before any cast (fp32 initialisation stays exact)
            self.shard = nn.Parameter(torch.zeros(self.end - self.start, dtype=master, device=device))
            for i, in_param, in_shard, length in self.layout.param_pieces(rank):
                piece = params[i].detach().reshape(-1).narrow(0, in_param, length)
                self.shard.data.narrow(0, in_shard, length).copy_(piece)
        self.flat = torch.zeros(self.layout.padded_numel, dtype=dtype, device=device)
        for p, offset in zip(params, self.layout.offsets):
            view = self.flat.narrow(0, offset, p.numel())
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)
        if master is not None:  # what every gather will hold: the master rounded to the gather dtype
            self.flat.copy_(self.flat.to(self.gather_dtype))
        else:
            self.shard = nn.Parameter(self.flat.narrow(0, self.start, self.end - self.start))
        self.has_master = master is not None
        self.grad_dtype = accum_dtype or self.shard.dtype  # by default the dtype the optimizer updates
        self.casts_grad = self.grad_dtype != self.shard.dtype  # shard.grad is a copy made in before_step
        self.accumulating = False  # a reduction of the current window went into the gradient storage
        # The group as the user built it (frozen ones included): how the full state dict numbers parameters.
        self.original_params = original_params
        self.flat_grad: Tensor | None = None  # persistent full gradient (stage 1, boundary)
        self.shard_grad: Tensor | None = None  # persistent shard accumulator (transient buckets)

    def shard_of_flat_grad(self) -> Tensor:
        """This rank's slice of the persistent full flat gradient (stage 1, ``"boundary"``)."""
        assert self.flat_grad is not None
        return self.flat_grad.narrow(0, self.start, self.end - self.start)

    @property
    def names_in_group_order(self) -> list[str]:
        """The trainable parameters' names in the order the user's param group holds them (the layout's is the
        module's registration order)."""
        name_of = {id(p): name for p, name in zip(self.params, self.names)}
        return [name_of[id(p)] for p in self.original_params if id(p) in name_of]


@dataclass
class OptimizerShards:
    """One optimizer's part of a ZeRO-1/2 engine (:meth:`ShardedOptimizer.shards`): the optimizer, its flat groups
    (numbered as its param groups) and the engine's process groups and rank. The state dicts of
    :mod:`lightning_zero.zero.stage12_state` are made of one such part each."""

    optimizer: torch.optim.Optimizer
    groups: list[FlatGroup]
    group: dist.ProcessGroup | None  # the shard group (``None``: the default group)
    replicate_group: dist.ProcessGroup | None  # hybrid sharding's replicas (``None``: none)
    rank: int  # in ``group``
    on_masters_loaded: Callable[[], None]  # a state dict brought master values: the engine gathers them after
