"""ZeRO stages 1 and 2: the user's optimizer rebuilt over this rank's shard, gradients reduced into it.

Runbook::

    engine = ShardedOptimizer(module, optimizer, stage=2, grad_sync="microbatch", bucket_cap_bytes=25 * 2**20)
    loss.backward()            # buckets reduced while backward runs; this rank's slice lands in the shard's .grad
    engine.before_step()       # the shard gradients ready for the optimizer (fp32 copies under grad_accum_dtype)
    engine.clip_grad_norm_(1.0)  # optional: global norm over all shards, as torch's ([Note: clipping as torch does])
    optimizer.step()           # the user's optimizer object, now stepping the shards only
    engine.after_step()        # all-gather the updated shards into the full parameters

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

[Note: gradient reduction] A gradient bucket is a contiguous range ``[lo, hi)`` of a flat group; each rank needs only
the part inside its shard. ``grad_reduction`` chooses how the bucket is averaged:
- ``"all_reduce"``: every rank receives the whole averaged bucket and keeps its part. A ring all-reduce moves
  2(N-1)/N of the bucket per rank, so with the parameter all-gather after the step ((N-1)/N) a step moves 3(N-1)/N
  x 4Ψ per rank, 1.5x DDP's 2(N-1)/N x 4Ψ.
- ``"reduce_scatter"`` (DeepSpeed's ``reduce_scatter``): the bucket is cut where shards end, and each piece is reduced
  (summed) into the rank that owns it and divided there, so every rank receives only its shard of the gradient, and a
  step moves about as much as DDP's. Only for transient buckets (stage 2, or stage 1 with ``"microbatch"``): stage 1's
  ``"boundary"`` mode keeps the full averaged gradient (``p.grad``) on every rank. Under hybrid sharding the pieces
  are reduced in the shard group, then each owned piece is all-reduced across the replicas.
- ``"auto"``: ``"reduce_scatter"`` where the backend has native reductions to one rank (NCCL) and the buckets are
  transient, else ``"all_reduce"``: on gloo the all-reduce measured faster (README "Communication options").
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zero.comm import collectives as comm
from lightning_zero.comm.bucketing import assign_buckets
from lightning_zero.dp.reducer import GradBucket, GradientReducer
from lightning_zero.optim.sharding import ShardAware, Sharding, restart_on_zero_grad, toggled_off
from lightning_zero.zero.grad_norm import clip_grad_norm_, total_grad_norm
from lightning_zero.zero.partition import FlatLayout, check_elementwise, flat_layout
from lightning_zero.zero.unused import HeldPieces, ParamPieces, param_pieces

GRAD_SYNC_MODES = ("boundary", "microbatch")
GRAD_REDUCTIONS = ("auto", "all_reduce", "reduce_scatter")


def check_in_optimizer(missing: list[str]) -> None:
    """Raise if trainable parameters (``missing``, by name) are in no optimizer param group."""
    if missing:
        raise ValueError(
            f"trainable parameters {missing} are in no optimizer param group: ZeRO shards the optimizers, so add"
            " them to a group or freeze them (requires_grad=False); under Fabric, set up all of the model's"
            " optimizers together: fabric.setup(model, optimizer_1, optimizer_2)"
        )


def check_disjoint(repeated: list[str]) -> None:
    """Raise if parameters (``repeated``, by name) are in more than one param group or optimizer."""
    if repeated:
        raise ValueError(
            f"parameters {repeated} are in more than one param group or optimizer: ZeRO shards each parameter's"
            " optimizer state once, so give each parameter to one optimizer"
        )


def index_of(optimizers: Sequence[torch.optim.Optimizer], optimizer: torch.optim.Optimizer) -> int:
    """``optimizer``'s position among the ``optimizers`` a ZeRO engine shards (by identity)."""
    k = next((k for k, opt in enumerate(optimizers) if opt is optimizer), None)
    if k is None:
        raise ValueError(f"{type(optimizer).__name__} is not an optimizer this ZeRO engine shards")
    return k


def set_aside_state(optimizer: torch.optim.Optimizer) -> dict | None:
    """[Note: state made before sharding] An optimizer may hold state before ZeRO rebuilds it over the shards:
    Adagrad makes its sums in its constructor, and a user may hand over one that has stepped. Returns its full state
    dict (``None`` if it holds none) and empties its state; the engine loads that back into the shards, as from a full
    checkpoint, so the first step starts from it as under ``ddp``."""
    if not optimizer.state:
        return None
    initial = optimizer.state_dict()
    optimizer.state.clear()
    return initial


def hyperparameters(param_groups: list[dict]) -> list[dict]:
    """Each param group without its ``params``."""
    return [{k: v for k, v in group.items() if k != "params"} for group in param_groups]


def check_group_count(saved: int, expected: int) -> None:
    if saved != expected:
        raise ValueError(f"optimizer state has {saved} param groups: expected {expected} as in the model")


def check_grad_reduction(grad_reduction: str, stage: int, grad_sync: str | None) -> None:
    """Raise unless ``grad_reduction`` is one of :data:`GRAD_REDUCTIONS` and applies to ``stage`` with ``grad_sync``
    (``None``: the stage's default) ([Note: gradient reduction])."""
    if grad_reduction not in GRAD_REDUCTIONS:
        raise ValueError(f"grad_reduction={grad_reduction!r} is invalid: expected one of {GRAD_REDUCTIONS}")
    if stage == 3 and grad_reduction != "auto":
        raise ValueError(
            f"grad_reduction={grad_reduction!r} applies to stages 1 and 2 only: stage=3 always reduce-scatters"
        )
    if grad_reduction == "reduce_scatter" and stage == 1 and grad_sync in (None, "boundary"):
        raise ValueError(
            "grad_reduction='reduce_scatter' needs stage=2, or grad_sync='microbatch' with stage=1: stage 1's"
            " 'boundary' mode keeps the full averaged gradient on every rank"
        )


class _FlatGroup:
    """One optimizer param group flattened: its layout, flat param, shard param and gradient storage."""

    def __init__(
        self,
        index: int,
        original_params: list[Tensor],
        params: list[Tensor],
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

    @property
    def names_in_group_order(self) -> list[str]:
        """The trainable parameters' names in the order the user's param group holds them (the layout's is the
        module's registration order)."""
        name_of = {id(p): name for p, name in zip(self.params, self.names)}
        return [name_of[id(p)] for p in self.original_params if id(p) in name_of]


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
        group: object = None,
        replicate_group: object = None,
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
        self.grad_reduction = self._resolve_reduction(grad_reduction)
        self.world_size, self.rank = comm.world_size(group), comm.rank(group)

        order = {id(p): i for i, p in enumerate(module.parameters())}
        names = {id(p): name for name, p in module.named_parameters()}
        seen: set[int] = set()
        self.groups: list[_FlatGroup] = []  # of every optimizer, in order
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
                flat_group = _FlatGroup(
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
            self.reducer = self._build_reducer(module, bucket_cap_bytes, find_unused_parameters, reduce_dtype)
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
                from lightning_zero.zero.stage12_state import load_full_state_dict  # it imports this module

                load_full_state_dict(self.shards(k), state)
            if isinstance(opt, ShardAware):  # [Note: shard-aware optimizers] in lightning_zero/optim/sharding.py
                opt.attach_sharding(Sharding(partial(self.total_grad_norm, opt), partial(self._gather_params, opt)))
            restart_on_zero_grad(opt, partial(self.restart_window, opt))  # [Note: zero_grad reaches the engine]

    def _resolve_reduction(self, grad_reduction: str) -> str:
        """``grad_reduction`` checked against the gradient storage, ``"auto"`` resolved ([Note: gradient
        reduction])."""
        check_grad_reduction(grad_reduction, self.stage, self.grad_sync)
        if grad_reduction != "auto":
            return grad_reduction
        nccl = comm.is_initialized() and dist.get_backend(self.group) == "nccl"
        return "reduce_scatter" if nccl and not self.persistent else "all_reduce"

    def _reduce_to_owners(self, bucket: GradBucket) -> comm.Handle:
        """Launch the average of ``bucket`` into the ranks that own its pieces ([Note: gradient reduction])."""
        g, lo, hi = self._bucket_range[id(bucket)]
        handles, mine = [], None
        for r in range(self.world_size):
            owned_lo, owned_hi = g.layout.owned(r, lo, hi)
            if owned_lo == owned_hi:
                continue
            piece = bucket.buffer.narrow(0, owned_lo - lo, owned_hi - owned_lo)
            dst = r if self.group is None else dist.get_global_rank(self.group, r)
            kwargs = {"group": self.group, "async_op": True, "tag": "grads", "dtype": self.reduce_dtype}
            handles.append(comm.reduce(piece, dst, "sum", **kwargs))
            mine = piece if r == self.rank else mine

        def average() -> None:
            if mine is None:
                return
            mine.div_(self.world_size)
            if self.replicate_group is not None:  # hybrid: the shard group's average, averaged across the replicas
                comm.all_reduce(mine, "avg", group=self.replicate_group, tag="grads", dtype=self.reduce_dtype)

        return comm.Handle(handles, then=average)

    def _build_reducer(
        self, module: nn.Module, bucket_cap_bytes: int, find_unused: bool, reduce_dtype: torch.dtype | None
    ) -> GradientReducer:
        # Every trainable parameter in reverse registration order, tagged with its group and flat offset.
        entries = []
        where = {id(p): (g, offset) for g in self.groups for p, offset in zip(g.params, g.layout.offsets)}
        for name, p in reversed(list(module.named_parameters())):
            if id(p) in where:
                entries.append((name, p, *where[id(p)]))
        layouts = assign_buckets(
            [p.numel() for _, p, _, _ in entries],
            [torch.empty((), dtype=g.grad_dtype).element_size() for _, _, g, _ in entries],
            [g.key for _, _, g, _ in entries],
            bucket_cap_bytes,
        )
        buckets, self._bucket_range = [], {}
        for layout in layouts:
            g = self.groups[layout.key]
            members = [entries[i] for i in layout.indices]
            lo = min(offset for *_, offset in members)
            hi = max(offset + p.numel() for _, p, _, offset in members)
            if hi == g.layout.numel:
                hi = g.layout.padded_numel  # the bucket holding the group's end carries the padding
            offsets = tuple(offset - lo for *_, offset in members)
            bucket = GradBucket(layout.indices, offsets, hi - lo, g.grad_dtype, g.flat.device)
            if self.persistent:
                if g.flat_grad is None:
                    g.flat_grad = torch.zeros_like(g.flat, dtype=g.grad_dtype)
                bucket.buffer = g.flat_grad.narrow(0, lo, hi - lo)
            self._bucket_range[id(bucket)] = (g, lo, hi)
            buckets.append(bucket)
        if not self.persistent:
            for g in self.groups:
                g.shard_grad = torch.zeros_like(g.shard, dtype=g.grad_dtype)
        return GradientReducer(
            [p for _, p, _, _ in entries],
            [name for name, *_ in entries],
            buckets,
            transient=not self.persistent,
            on_reduced=self._on_bucket_reduced,
            find_unused_parameters=find_unused,
            group=self.group if self.replicate_group is None else None,  # hybrid: the average over every rank
            reduce_dtype=reduce_dtype,
            reduce_bucket=self._reduce_to_owners if self.grad_reduction == "reduce_scatter" else None,
            ignored=lambda p: not where[id(p)][0].shard.requires_grad,  # [Note: toggled-off optimizers]
        )

    def _on_bucket_reduced(self, bucket: GradBucket) -> None:
        g, lo, hi = self._bucket_range[id(bucket)]
        first, g.accumulating = not g.accumulating, True  # first: the first reduction since the last step
        if self.persistent:
            if not g.casts_grad:
                g.shard.grad = self._shard_of_flat_grad(g)
            return
        if g.casts_grad and first:
            g.shard_grad.zero_()  # the last window's sum went to shard.grad in before_step
        elif not g.casts_grad and g.shard.grad is None:  # zeroed by the optimizer: a new window
            g.shard_grad.zero_()
            g.shard.grad = g.shard_grad
        owned_lo, owned_hi = g.layout.owned(self.rank, lo, hi)
        if owned_lo < owned_hi:
            g.shard_grad.narrow(0, owned_lo - g.start, owned_hi - owned_lo).add_(
                bucket.buffer.narrow(0, owned_lo - lo, owned_hi - owned_lo)
            )

    @staticmethod
    def _shard_of_flat_grad(g: _FlatGroup) -> Tensor:
        assert g.flat_grad is not None
        return g.flat_grad.narrow(0, g.start, g.end - g.start)

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
    def _groups_of(self, optimizer: torch.optim.Optimizer | None) -> list[_FlatGroup]:
        if optimizer is None:
            return self.groups
        k = index_of(self.optimizers, optimizer)
        return [g for g in self.groups if g.optimizer_index == k]

    def shards(self, k: int) -> OptimizerShards:
        """Optimizer ``k``'s part of the engine (what its state dicts are made of)."""
        return OptimizerShards(self, k)

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

    def _norm_arguments(self, groups: list[_FlatGroup]) -> dict:
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

    def _end_window(self, groups: list[_FlatGroup]) -> None:
        """The reducer's window of these groups' parameters ends (each optimizer has its own)."""
        if self.reducer is not None:
            self.reducer.end_window(self.reducer.indices_of(p for g in groups for p in g.params))

    @property
    def param_pieces(self) -> list[ParamPieces]:
        """Every trainable parameter with its pieces in this rank's shard."""
        return self._pieces_of(self.groups)

    def _pieces_of(self, groups: list[_FlatGroup]) -> list[ParamPieces]:
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
                grad = self._shard_of_flat_grad(g) if self.persistent else g.shard_grad
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

    def set_shard_grads(self, values: Tensor, unused: set[str] = frozenset()) -> None:
        """Gradients from outside (``reduce_gradients=False``): ``values`` holds this rank's shard of every group's
        gradient, group after group, without the padding. They become the shard gradients; stage 1 (``"boundary"``)
        all-gathers them into its full flat gradient, whose views become the ``p.grad`` (as after its reduction).
        ``unused``: the parameters no rank used in the window (with ``find_unused_parameters``), which the step then
        leaves untouched and which get no ``p.grad``."""
        self._unused_given = set(unused)
        offset = 0
        for g in self.groups:
            length = max(min(g.end, g.layout.numel) - g.start, 0)
            target = self._shard_of_flat_grad(g) if self.persistent else g.shard_grad
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


class OptimizerShards:
    """Optimizer ``index``'s part of a ZeRO-1/2 engine: its flat groups (numbered as its param groups) and the
    optimizer, with the rest of the engine's attributes (``group``, ``rank``, ...) read through. The state dicts of
    :mod:`lightning_zero.zero.stage12_state` are made of one such part each."""

    def __init__(self, engine: ShardedOptimizer, index: int) -> None:
        self.engine, self.index = engine, index
        self.optimizer = engine.optimizers[index]
        self.groups = [g for g in engine.groups if g.optimizer_index == index]

    @property
    def masters_loaded(self) -> bool:
        return self.engine.masters_loaded

    @masters_loaded.setter
    def masters_loaded(self, value: bool) -> None:
        self.engine.masters_loaded = value

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)
