"""ZeRO stages 1 and 2: the user's optimizer rebuilt over this rank's shard, gradients reduced into it.

Runbook::

    engine = ShardedOptimizer(module, optimizer, stage=2, grad_sync="microbatch", bucket_cap_bytes=25 * 2**20)
    loss.backward()            # buckets reduced while backward runs; this rank's slice lands in the shard's .grad
    engine.before_step()       # the shard gradients ready for the optimizer (fp32 copies under grad_accum_dtype)
    engine.clip_grad_norm_(1.0)  # optional: global norm over all shards, as torch's ([Note: clipping as torch does])
    optimizer.step()           # the user's optimizer object, now stepping the shards only
    engine.after_step()        # all-gather the updated shards into the full parameters

The tensors an engine holds, and where gradients are stored by ``stage`` and ``grad_sync``: [Note: tensor roles] in
``lightning_zero/zero/flat_group.py``.

How gradient buckets are averaged and reduced into the shards: [Note: gradient reduction] in
``lightning_zero/zero/stage12_reduction.py``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from contextlib import AbstractContextManager
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zero.comm import collectives as comm
from lightning_zero.dp.reducer import GradientReducer
from lightning_zero.optim.sharding import ShardAware, Sharding, restart_on_zero_grad, toggled_off
from lightning_zero.zero.flat_group import FlatGroup, OptimizerShards
from lightning_zero.zero.grad_norm import clip_grad_norm_, total_grad_norm
from lightning_zero.zero.optimizer_checks import (
    GRAD_SYNC_MODES,
    check_disjoint,
    check_in_optimizer,
    index_of,
    set_aside_state,
)
from lightning_zero.zero.partition import check_elementwise
from lightning_zero.zero.stage12_reduction import ShardGradients, resolve_grad_reduction
from lightning_zero.zero.stage12_state import load_full_state_dict
from lightning_zero.zero.unused import HeldPieces, ParamPieces, param_pieces


class ShardedOptimizer:
    """ZeRO-1/2 over ``module`` and the user's ``optimizer`` (rebuilt in place over this rank's shards).

    Args:
        module: the model; every trainable parameter must be in some param group of ``optimizer``.
        optimizer: a ``torch.optim`` optimizer ([Note: elementwise optimizers] in ``lightning_zero/zero/partition.py``);
            state it already holds is sharded with it ([Note: state made before sharding]).
        stage: 1 or 2; sets the default of ``grad_sync``.
        grad_sync: ``"boundary"`` or ``"microbatch"`` (see the module docstring); ``None``: ``"boundary"`` for
            stage 1, ``"microbatch"`` for stage 2.
        bucket_cap_bytes: gradient bucket cap in bytes.
        cast_dtype: dtype the module's parameters are cast to (``None``: as they are).
        gather_dtype: dtype of the all-gather of the updated shards (``None``: the parameters').
        master_dtype: dtype of the shard the optimizer updates, kept apart when the parameters are in, or gathered
            in, another ([Note: tensor roles], master shard).
        reduce_dtype: dtype gradients are all-reduced in (``None``: the accumulation dtype).
        accum_dtype: dtype gradients are stored and accumulated in (``None``: the dtype the optimizer updates; see
            [Note: tensor roles]).
        find_unused_parameters: allow parameters without a gradient in a backward pass (see
            :class:`~lightning_zero.dp.reducer.GradientReducer`); a parameter no rank used in an optimizer step is left
            untouched by it ([Note: parameters no rank used] in ``lightning_zero/zero/unused.py``).
        group: process group the shards split over (``None``: the default group).
        grad_reduction: ``"auto"``, ``"all_reduce"`` or ``"reduce_scatter"``: how gradient buckets are averaged
            ([Note: gradient reduction]).
        replicate_group: hybrid sharding ([Note: hybrid sharding] in ``lightning_zero/zero/hybrid.py``): the group
            of ranks holding the same shard as this one; ``group`` is then this rank's shard group, and gradients
            are averaged over the default group, which spans both.
        reduce_gradients: ``False``: no reducer and no autograd hooks; the gradient shard comes from outside, through
            :meth:`set_shard_grads` (robust ZeRO: each rank's robust aggregate of its shard).
        elementwise_optimizers: optimizer classes the user declares elementwise ([Note: elementwise optimizers] in
            ``lightning_zero/zero/partition.py``).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        *,
        stage: int,
        grad_sync: str | None = None,
        bucket_cap_bytes: int,
        find_unused_parameters: bool = False,
        cast_dtype: torch.dtype | None = None,
        gather_dtype: torch.dtype | None = None,
        master_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        accum_dtype: torch.dtype | None = None,
        grad_reduction: str = "auto",
        group: dist.ProcessGroup | None = None,
        replicate_group: dist.ProcessGroup | None = None,
        reduce_gradients: bool = True,
        elementwise_optimizers: Collection[type] = (),
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(f"stage={stage!r} is invalid for ShardedOptimizer: expected 1 or 2")
        grad_sync = grad_sync or ("boundary" if stage == 1 else "microbatch")
        if grad_sync not in GRAD_SYNC_MODES:
            raise ValueError(f"grad_sync={grad_sync!r} is invalid: expected one of {GRAD_SYNC_MODES}")
        optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        for opt in optimizers:
            check_elementwise(opt, elementwise_optimizers)
        initial = [set_aside_state(opt) for opt in optimizers]
        self.stage, self.grad_sync, self.group, self.optimizers = stage, grad_sync, group, optimizers
        self.persistent = stage == 1 and grad_sync == "boundary"
        self.replicate_group = replicate_group
        self.grad_reduction = resolve_grad_reduction(grad_reduction, stage, grad_sync, self.persistent)
        self.world_size, self.rank = comm.world_size(group), comm.rank(group)

        order = {id(p): i for i, p in enumerate(module.parameters())}
        names = {id(p): name for name, p in module.named_parameters()}
        seen: set[int] = set()
        self.groups: list[FlatGroup] = []  # of every optimizer, in order
        for k, opt in enumerate(optimizers):
            for index, param_group in enumerate(opt.param_groups):
                unknown = [p for p in param_group["params"] if id(p) not in order]
                if unknown:
                    raise ValueError(
                        f"param group {index} holds {len(unknown)} tensor(s) that are not module parameters"
                    )
                # Registration order, so that reverse-order buckets are contiguous ranges of the flat buffer.
                params = sorted((p for p in param_group["params"] if p.requires_grad), key=lambda p: order[id(p)])
                check_disjoint([names[id(p)] for p in params if id(p) in seen])
                seen.update(id(p) for p in params)
                flat_group = FlatGroup(
                    index,
                    list(param_group["params"]),
                    params,
                    [names[id(p)] for p in params],
                    self.world_size,
                    self.rank,
                    cast_dtype,
                    gather_dtype,
                    master_dtype,
                    accum_dtype,
                    optimizer_index=k,
                    key=len(self.groups),
                )
                param_group["params"] = [flat_group.shard]
                self.groups.append(flat_group)
        check_in_optimizer([name for name, p in module.named_parameters() if p.requires_grad and id(p) not in seen])
        self.masters_loaded = False
        self.reduce_dtype = reduce_dtype
        self.find_unused_parameters = find_unused_parameters
        self._unused_given: set[str] = set()  # reduce_gradients=False: what set_shard_grads was told no rank used
        self.reducer: GradientReducer | None = None
        if reduce_gradients:
            gradients = ShardGradients(
                self.groups,
                persistent=self.persistent,
                grad_reduction=self.grad_reduction,
                reduce_dtype=reduce_dtype,
                group=group,
                replicate_group=replicate_group,
            )
            self.reducer = gradients.reducer(module, bucket_cap_bytes, find_unused_parameters)
        else:  # the gradient storage the reducer would have made: stage 1's full flat gradient, else the shard's
            for g in self.groups:
                if self.persistent:
                    g.flat_grad = torch.zeros_like(g.flat, dtype=g.grad_dtype)
                else:
                    g.shard_grad = torch.zeros_like(g.shard, dtype=g.grad_dtype)
        self._held = [HeldPieces(opt) for opt in optimizers]
        self._pieces = [param_pieces(g.names, g.shard, g.layout, self.rank) for g in self.groups]
        for k, (opt, state) in enumerate(zip(optimizers, initial)):
            if state is not None:
                load_full_state_dict(self.shards(k), state)
            if isinstance(opt, ShardAware):  # [Note: shard-aware optimizers] in lightning_zero/optim/sharding.py
                opt.attach_sharding(Sharding(partial(self.total_grad_norm, opt), partial(self._gather_params, opt)))
            restart_on_zero_grad(opt, partial(self.restart_window, opt))  # [Note: zero_grad reaches the engine]

    # ---------------------------------------------------------------- public
    @property
    def shard_params(self) -> list[nn.Parameter]:
        return [g.shard for g in self.groups]

    @property
    def strategy_buffers(self) -> list[Tensor]:
        """Persistent tensors the engine owns beyond params, grads and optimizer state (flat buffers included)."""
        persistent = [g.flat for g in self.groups]
        persistent += [t for g in self.groups for t in (g.flat_grad, g.shard_grad) if t is not None]
        return persistent + (self.reducer.buffers if self.reducer is not None else [])

    def toggled_off(self) -> AbstractContextManager:
        """Backward with the module parameters of toggled-off optimizers off ([Note: toggled-off optimizers] in
        ``lightning_zero/optim/sharding.py``)."""
        return toggled_off((p, g.shard) for g in self.groups for p in g.params)

    # Per optimizer: ``optimizer=None`` means every optimizer's groups.
    def _groups_of(self, optimizer: torch.optim.Optimizer | None) -> list[FlatGroup]:
        if optimizer is None:
            return self.groups
        k = index_of(self.optimizers, optimizer)
        return [g for g in self.groups if g.optimizer_index == k]

    def shards(self, k: int) -> OptimizerShards:
        """Optimizer ``k``'s part of the engine (what its state dicts are made of)."""
        groups = [g for g in self.groups if g.optimizer_index == k]
        return OptimizerShards(self.optimizers[k], groups, self.group, self.replicate_group, self.rank, self._loaded)

    def _loaded(self) -> None:
        """A state dict brought master values into the shards: :meth:`sync_after_load` gathers the parameters."""
        self.masters_loaded = True

    def clip_grad_norm_(self, max_norm: float, optimizer: torch.optim.Optimizer | None = None) -> Tensor:
        """Scale the shard gradients (of ``optimizer``'s parameters) so the *global* gradient norm is at most
        ``max_norm``; return that norm."""
        groups = self._groups_of(optimizer)
        return clip_grad_norm_(self._pieces_of(groups), max_norm, **self._norm_arguments(groups))

    def total_grad_norm(self, optimizer: torch.optim.Optimizer | None = None) -> Tensor:
        """The 2-norm of the whole averaged gradient (of ``optimizer``'s parameters), as ``get_total_norm`` of the
        gradients under ``ddp`` (collective)."""
        groups = self._groups_of(optimizer)
        return total_grad_norm(self._pieces_of(groups), **self._norm_arguments(groups))

    def _norm_arguments(self, groups: list[FlatGroup]) -> dict:
        order = [name for g in groups for name in g.names_in_group_order]
        device = self.groups[0].flat.device
        return {"order": order, "unused": self.unused_everywhere, "group": self.group, "device": device}

    def restart_window(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Drop the gradients of this accumulation window (of ``optimizer``'s parameters): what ``zero_grad`` does
        under ``ddp``, wherever the engine keeps them (stage 1's full gradient behind ``p.grad``, a window's buckets
        not yet reduced, the accumulator in ``accum_dtype``); the optimizer's ``zero_grad`` calls it ([Note:
        zero_grad reaches the engine] in ``lightning_zero/optim/sharding.py``)."""
        groups = self._groups_of(optimizer)
        self._end_window(groups)
        for g in groups:
            g.accumulating = False
            g.shard.grad = None
            for p in g.params:
                p.grad = None

    def _end_window(self, groups: list[FlatGroup]) -> None:
        """The reducer's window of these groups' parameters ends (each optimizer has its own)."""
        if self.reducer is not None:
            self.reducer.end_window(self.reducer.indices_of(p for g in groups for p in g.params))

    @property
    def param_pieces(self) -> list[ParamPieces]:
        """Every trainable parameter with its pieces in this rank's shard."""
        return self._pieces_of(self.groups)

    def _pieces_of(self, groups: list[FlatGroup]) -> list[ParamPieces]:
        return [p for g in groups for p in self._pieces[g.key]]

    @property
    def unused_everywhere(self) -> set[str]:
        """Parameters no rank used in the last synchronised window (with ``find_unused_parameters``)."""
        if self.reducer is None:
            return set(self._unused_given)
        return {self.reducer.names[i] for i in self.reducer.unused_everywhere}

    def before_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Between the last backward of a window and ``optimizer``'s update (before unscaling and clipping): the shard
        gradients stored in ``accum_dtype`` copied to the optimizer's dtype, and what no rank used held."""
        groups = self._groups_of(optimizer)
        for g in groups:
            if g.casts_grad and g.accumulating:
                grad = g.shard_of_flat_grad() if self.persistent else g.shard_grad
                assert grad is not None  # transient buckets: the shard accumulator exists from the start
                g.shard.grad = grad.to(g.shard.dtype)  # dropped again in after_step
                g.accumulating = False
        if self.find_unused_parameters:
            for k in sorted({g.optimizer_index for g in groups}):
                pieces = self._pieces_of([g for g in groups if g.optimizer_index == k])
                self._held[k].hold(pieces, self.unused_everywhere)

    def after_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Put held pieces back, all-gather the updated shards (of ``optimizer``) into the full parameters, end the
        window (and drop stage 1's full local gradients and the shard gradients' copies of ``accum_dtype``)."""
        groups = self._groups_of(optimizer)
        for k in sorted({g.optimizer_index for g in groups}):
            self._held[k].restore()
        self._end_window(groups)
        for g in groups:
            g.accumulating = False
            if g.casts_grad:
                g.shard.grad = None
        self._gather_params(optimizer)
        if self.persistent:
            for g in groups:
                for p in g.params:
                    p.grad = None

    def _gather_params(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        for g in self._groups_of(optimizer):  # a master shard is rounded to the gather dtype on the way
            comm.all_gather(g.flat, g.shard.detach(), group=self.group, tag="params", dtype=g.gather_dtype)

    def set_shard_grads(self, values: Tensor, unused: Collection[str] = frozenset()) -> None:
        """Gradients from outside (``reduce_gradients=False``): ``values`` holds this rank's shard of every group's
        gradient, group after group, without the padding. They become the shard gradients; stage 1 (``"boundary"``)
        all-gathers them into its full flat gradient, whose views become the ``p.grad`` (as after its reduction).
        ``unused``: the parameters no rank used in the window (with ``find_unused_parameters``), which the step then
        leaves untouched and which get no ``p.grad``."""
        self._unused_given = set(unused)
        offset = 0
        for g in self.groups:
            length = max(min(g.end, g.layout.numel) - g.start, 0)
            target = g.shard_of_flat_grad() if self.persistent else g.shard_grad
            assert target is not None
            target.narrow(0, 0, length).copy_(values.narrow(0, offset, length))  # the padding stays zero
            offset += length
            g.shard.grad = target
            if self.persistent:
                assert g.flat_grad is not None
                comm.all_gather(g.flat_grad, target, group=self.group, tag="grads")
                for name, p, start in zip(g.names, g.params, g.layout.offsets):
                    p.grad = None if name in unused else g.flat_grad.narrow(0, start, p.numel()).view_as(p)
        if offset != values.numel():
            raise ValueError(f"set_shard_grads got {values.numel()} values: this rank's shards hold {offset}")

    def remove(self) -> None:
        if self.reducer is not None:
            self.reducer.remove()
        for opt in self.optimizers:
            restart_on_zero_grad(opt, None)

    def restore_masters(self) -> None:
        """After a fit: the module's parameters hold the master values in the dtype the module had (not the values
        rounded to ``gather_dtype``), as an unsharded optimizer would have left them. Collective; a module that was
        cast gets new full-size parameters."""
        for g in self.groups:
            if not g.has_master:
                continue
            if g.flat.dtype == g.module_dtype:
                comm.all_gather(g.flat, g.shard.detach(), group=self.group, tag="params")
                continue
            full = torch.empty(g.layout.padded_numel, dtype=g.module_dtype, device=g.flat.device)
            comm.all_gather(full, g.shard.detach(), group=self.group, tag="params")
            for p, offset in zip(g.params, g.layout.offsets):
                p.data = full.narrow(0, offset, p.numel()).view_as(p)

    def sync_after_load(self) -> None:
        """After a checkpoint was loaded into the module and the optimizer: the parameters from master values
        loaded with the optimizer state, or else the masters from the loaded parameters."""
        if self.masters_loaded:
            self._gather_params()
        for g in self.groups:
            if g.has_master and not self.masters_loaded:
                g.shard.data.copy_(g.flat.narrow(0, g.start, g.end - g.start))
        self.masters_loaded = False
