"""ZeRO stage 3: parameters sharded per unit, gathered just before use (with prefetch) and freed right after.

Runbook::

    engine = ShardedParams(model, auto_wrap_policy={Block}, device=device)  # shards (or builds, if on meta) the model
    optimizer = torch.optim.AdamW(model.parameters())                       # the user's optimizer, as usual
    engine.attach_optimizer(optimizer)       # rebuilt in place over this rank's flat shards
    loss = model(x).sum(); loss.backward()   # units gathered/freed by hooks; gradients reduce-scattered per unit
    engine.clip_grad_norm_(1.0); optimizer.step(); optimizer.zero_grad()

[Note: tensor roles] (units: [Note: units] in ``lightning_zero/zero/stage3/units.py``; layout: [Note: flat layout] in
``lightning_zero/zero/partition.py``) A unit's parameters are split into *segments*: one per optimizer param group (and
one for frozen parameters), each laid out flat and padded to a multiple of N.

- *shard* (``segment.shard``): an ``nn.Parameter`` with this rank's ``padded / N`` elements of the segment; the only
  persistent copy of the weights. The user's optimizer is rebuilt to step the shards (8Ψ/N of AdamW state).
- *unsharded flat* (``segment.full``): the all-gather output. Its storage is resized to the full size for a gather
  and back to 0 bytes when the unit is freed, so the module's parameters can be views of it, and so can tensors
  autograd saved for backward (they see the storage again when backward re-gathers the unit).
- *module parameter*: the user's ``nn.Parameter`` objects stay (the optimizer, ``named_parameters`` and shapes work
  as usual). Gathered, ``p.data`` is a view of the unsharded flat; sharded, it is a *placeholder*: one NaN element
  expanded to ``p``'s shape (full shape, 4 bytes, in-place writes fail). NaN, not zero, so that a computation that
  reads a parameter outside its unit's forward and backward is visibly wrong ([Note: reading sharded parameters] in
  ``lightning_zero/zero/stage3/placeholder_reads.py``).
- *unsharded gradient* (``segment.grad_full``): the unit's gradients gathered into one flat buffer as autograd
  produces them (``p.grad`` is dropped at once), reduce-scattered (average) when the unit's last gradient arrives.
  The result is added to ``shard.grad``, the persistent 4Ψ/N accumulator.
- mixed precision ([Note: precision policy] in ``lightning_zero/training/precision.py``): the shard is in
  ``master_dtype`` (fp32: the master weights the optimizer updates, and what checkpoints hold); it is all-gathered in
  ``gather_dtype`` (bf16: half the bytes; the values the module computes with are the masters rounded to it) into the
  unsharded flat, which keeps the module's dtype (or ``cast_dtype``); unsharded gradients are in the shard's dtype
  (accumulation) and reduce-scattered in ``reduce_dtype``.
- quantized communication (ZeRO++, [Note: blockwise quantization] in ``lightning_zero/comm/quantize.py``), off by
  default. *qwZ* (``weight_block_size``): each rank quantizes its shard to int8 blocks for every gather, and every rank
  dequantizes all N pieces, its own included, into the unsharded flat (rounded to ``gather_dtype`` on the way): every
  rank computes with the same weights, the masters quantized. The shard itself, which the optimizer updates and
  checkpoints hold, is untouched, and so is anything gathered for a state dict or handed back after a fit;
  :meth:`summon_full_params` shows the dequantized weights, as it shows ``gather_dtype``-rounded ones under mixed
  precision (the values the module computes with). *qgZ* (``grad_block_size``): the
  unsharded gradient's N chunks are quantized each in blocks of their own, exchanged all-to-all, and each rank sums
  the N dequantized contributions to its chunk in fp32 ([Note: quantized reduce-scatter] in
  ``lightning_zero/comm/quantized.py``); ``reduce_dtype`` then must be fp32 or ``None``. Bytes per step:
  [Note: stage-3 traffic] in ``lightning_zero/zero/stage3/traffic.py``.

Per step: forward gathers each unit (4Ψ, while the next unit's gather is in flight) and frees it after its forward,
unless ``reshard_after_forward=False``; backward re-gathers it (another 4Ψ, prefetching the unit that ran before it),
reduce-scatters its gradients (4Ψ) and frees everything. The root unit is gathered on first use and kept until its
gradients are reduced (its weights, e.g. embedding and LM head, are used at both ends of the model).

``grad_sync="microbatch"`` (default) reduces every backward into ``shard.grad``; ``"boundary"`` keeps each segment's
unsharded gradient through the non-boundary micro-batches (inside :meth:`no_sync`: no communication, +4Ψ) and
reduces once at the boundary. Both are exact.

[Note: gather sequence check] (in ``lightning_zero/zero/stage3/gather_order.py``): every rank must gather the units in
the same order; gathers that repeat the previous pass's order need no exchange, others are checked first.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from lightning_zero.comm import collectives as comm
from lightning_zero.dp.unused import UsedParams
from lightning_zero.optim.sharding import ShardAware, Sharding, restart_on_zero_grad
from lightning_zero.zero.optimizer_checks import GRAD_SYNC_MODES, check_disjoint, check_in_optimizer, set_aside_state
from lightning_zero.zero.partition import check_elementwise
from lightning_zero.zero.stage3.backward import GraphTask, InputsDone, grad_accumulator
from lightning_zero.zero.stage3.gather import Placeholders, UnitGather
from lightning_zero.zero.stage3.gather_order import GatherOrder
from lightning_zero.zero.stage3.lifecycle import UnitLifecycle
from lightning_zero.zero.stage3.materialize import build_meta_modules, load_real_tensors
from lightning_zero.zero.stage3.placeholder_reads import StateDictGuard
from lightning_zero.zero.stage3.reduce import GradReducer
from lightning_zero.zero.stage3.segments import FROZEN, TRAINABLE, Segment, SegmentKey, Unit
from lightning_zero.zero.stage3.state import load_optimizer_state_dict
from lightning_zero.zero.stage3.traffic import SegmentTraffic, gathers_per_step, step_nbytes
from lightning_zero.zero.stage3.units import ROOT, plan_units, root_owners
from lightning_zero.zero.stage3.windows import GradWindows
from lightning_zero.zero.unused import HeldPieces

_ENGINES: weakref.WeakKeyDictionary[nn.Module, weakref.ref[ShardedParams]] = weakref.WeakKeyDictionary()
"""Module -> its engine (weak both ways: the module's hooks keep the engine alive as long as the module lives)."""


class ShardedParams(UnitLifecycle, GradWindows):
    """ZeRO-3 over ``module``: see the module docstring. Its parts: the unit hooks (:class:`UnitLifecycle`), the
    accumulation windows (:class:`GradWindows`), the gathers (:class:`UnitGather`) and the gradient reductions
    (:class:`GradReducer`).

    Args:
        module: the model, with real parameters (sharded from rank 0's values) or on the meta device (built here
            module by module with ``reset_parameters()``, each rank keeping only its pieces).
        auto_wrap_policy: the module classes each instance of which is a unit ([Note: units]).
        min_num_params: else, units of at least this many parameters ([Note: units]).
        reshard_after_forward: free a unit after its forward (``True``) or keep it until its backward.
        grad_sync: ``"microbatch"`` or ``"boundary"``.
        device: where shards and gathered parameters live.
        rng_state: ``{"cpu": state, "cuda": state}`` to build meta-device modules from ([Note: meta initialisation]
            in ``lightning_zero/zero/stage3/materialize.py``); default: the current RNG state.
        timeout: of the gather-sequence check's own process group (``None``: torch's default); pass the main
            group's, so a rank that stops gathering makes the others fail as soon as on the main group.
        find_unused_parameters: allow trainable parameters without a gradient in a backward pass; see
            [Note: unused parameters] in ``lightning_zero/zero/stage3/windows.py``. Off: such a parameter raises an
            error naming it.
        cast_dtype: the dtype the module's parameters are cast to for compute ([Note: tensor roles]); ``None``:
            the parameters' own dtype (as for the next three).
        gather_dtype: the dtype the shards are all-gathered in.
        master_dtype: the dtype of the sharded master copy the optimizer updates.
        reduce_dtype: the dtype gradients are reduce-scattered in.
        weight_block_size: all-gather the parameters as blockwise int8 in blocks of this many elements (ZeRO++'s
            qwZ; [Note: tensor roles]); ``None`` (default): in ``gather_dtype``, exactly.
        grad_block_size: reduce-scatter the gradients as blockwise int8 (ZeRO++'s qgZ), reduced in fp32; ``None``
            (default): in ``reduce_dtype``, exactly.
        group: process group the shards split over (``None``: the default group).
        replicate_group: hybrid sharding ([Note: hybrid sharding] in ``lightning_zero/zero/hybrid.py``): the group of
            ranks holding the same shards as this one; ``group`` is then this rank's shard group, gradients reduced
            in it are averaged across this group too, and the default group spans both.
        check_group: a gloo group of ``group``'s ranks for [Note: gather sequence check], when ranks shard over
            different groups (``None``: created here over ``group``'s ranks, which every rank must then share).
        elementwise_optimizers: optimizer classes the user declares elementwise ([Note: elementwise optimizers] in
            ``lightning_zero/zero/partition.py``).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        auto_wrap_policy: set[type] | None = None,
        min_num_params: int | None = None,
        reshard_after_forward: bool = True,
        grad_sync: str = "microbatch",
        device: torch.device | str = "cpu",
        rng_state: Mapping[str, Tensor] | None = None,
        timeout: timedelta | None = None,
        find_unused_parameters: bool = False,
        cast_dtype: torch.dtype | None = None,
        gather_dtype: torch.dtype | None = None,
        master_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        weight_block_size: int | None = None,
        grad_block_size: int | None = None,
        group: Any = None,
        replicate_group: Any = None,
        check_group: Any = None,
        elementwise_optimizers: Collection[type] = (),
    ) -> None:
        if grad_sync not in GRAD_SYNC_MODES:
            raise ValueError(f"grad_sync={grad_sync!r} is invalid: expected one of {GRAD_SYNC_MODES}")
        if grad_block_size is not None and reduce_dtype not in (None, torch.float32):
            raise ValueError(
                f"reduce_dtype={reduce_dtype} conflicts with grad_block_size={grad_block_size}: quantized gradients are"
                " reduced in fp32 after dequantizing; pass reduce_dtype=None or torch.float32"
            )
        if ShardedParams.of(module) is not None:
            raise ValueError("the module is sharded already (by an earlier fit): reuse ShardedParams.of(module)")
        _ENGINES[module] = weakref.ref(self)
        self.module, self.group, self.device = module, group, torch.device(device)
        self.replicate_group = replicate_group
        job = group if replicate_group is None else None  # every rank of the job: initial weights, checks
        self.reshard_after_forward, self.grad_sync = reshard_after_forward, grad_sync
        self.world_size, self.rank = comm.world_size(group), comm.rank(group)
        self._dtypes = (cast_dtype, gather_dtype, master_dtype)  # of every segment
        self._module_dtypes = {id(p): p.dtype for p in module.parameters()}  # before any cast or placeholder
        self.reduce_dtype = reduce_dtype
        self.weight_block_size, self.grad_block_size = weight_block_size, grad_block_size
        self.require_backward_grad_sync = True
        self.elementwise_optimizers = elementwise_optimizers
        self.optimizers: list[torch.optim.Optimizer] = []
        self.original_groups_of: list[list[list[nn.Parameter]]] = []  # per optimizer, as the user built them
        self._placeholders = Placeholders(self.device)
        self._where: dict[int, tuple[Unit, Segment, int]] = {}  # id(param) -> its unit, segment and index there
        self._names = {id(p): name for name, p in module.named_parameters()}
        plans = plan_units(module, auto_wrap_policy, min_num_params)
        self.units = [Unit(i, plan) for i, plan in enumerate(plans)]
        for unit in self.units:
            params = [module.get_parameter(name) for name in unit.plan.param_names]
            self._build_segments(unit, [TRAINABLE if p.requires_grad else FROZEN for p in params], params)
        load_real_tensors(module, self._load_param, self.device, job)
        build_meta_modules(module, self._load_param, self.device, rng_state, job)
        self._gather_order = GatherOrder(
            [u.plan.label for u in self.units],
            group=job,
            timeout=timeout,
            check_group=check_group,
            mode=lambda: (torch.is_grad_enabled(), self.require_backward_grad_sync),
        )
        self._job_group = job
        self._gathers = UnitGather(group, self.rank, weight_block_size, self._gather_order, self._placeholders)
        self._order: list[int] = []  # units in the order this pass gathered them in forward
        self._last_order = [u.index for u in self.units]  # the previous pass's (prefetch guide)
        self._reads_depth, self._read_mode = 0, None  # gathering_reads
        self._tasks: dict[int, GraphTask] = {}  # backward passes running ([Note: graph tasks])
        self._input_hooks: list[InputsDone] = []  # this pass's
        self.released = False
        self._guard = StateDictGuard(self._where)
        self._hooks = self._register_hooks()
        owners = {id(m): m for m in module.modules() if any(id(p) in self._where for p in m.parameters(recurse=False))}
        self._hooks += [m.register_state_dict_pre_hook(self._guard.check) for m in owners.values()]
        # [Note: unused parameters] in lightning_zero/zero/stage3/windows.py
        self.find_unused_parameters = find_unused_parameters
        self._used = UsedParams([(name, p) for name, p in module.named_parameters() if p.requires_grad])
        self._reducer = GradReducer(
            self.units,
            group=group,
            rank=self.rank,
            reduce_dtype=reduce_dtype,
            grad_block_size=grad_block_size,
            replicate_group=replicate_group,
            find_unused_parameters=find_unused_parameters,
            gather_order=self._gather_order,
        )
        self._accumulators = {id(p): grad_accumulator(p) for u in self.units for p in u.trainable}
        self._held: list[HeldPieces] = []  # per optimizer

    @staticmethod
    def of(module: nn.Module) -> ShardedParams | None:
        """The engine that shards ``module``, if any (its hooks and shards outlive a fit)."""
        ref = _ENGINES.get(module)
        return ref() if ref is not None else None

    # ------------------------------------------------------------ construction
    def _build_segments(self, unit: Unit, keys: list[SegmentKey], params: list[nn.Parameter]) -> None:
        unit.segments = []
        for key in dict.fromkeys(keys):
            members = [p for p, k in zip(params, keys) if k == key]
            dtypes = {p.dtype for p in members}
            if len(dtypes) > 1:
                raise ValueError(f"unit {unit.plan.label!r} mixes dtypes {sorted(map(str, dtypes))} in one segment")
            names = [self._names[id(p)] for p in members]
            unit.segments.append(
                Segment(
                    key,
                    members,
                    names,
                    self.world_size,
                    self.rank,
                    self.device,
                    self._module_dtypes[id(members[0])],
                    *self._dtypes,
                )
            )
        unit.trainable = [p for p in unit.params if p.requires_grad]
        self._where.update({id(p): (unit, s, i) for s in unit.segments for i, p in enumerate(s.params)})

    def shard_dtype(self, p: Tensor) -> torch.dtype:
        """The dtype ``p``'s values are kept in (its shard's: the master dtype under mixed precision)."""
        return self._where[id(p)][1].shard.dtype

    def _load_param(self, p: nn.Parameter) -> None:
        _, segment, i = self._where[id(p)]
        segment.load_param(i, p.data)
        p.data = self._placeholders.of(p, segment)

    def _register_hooks(self) -> list[Any]:
        # [Note: hooks outside compiled code] A module compiled in place (``module.compile()``) compiles its whole
        # ``_call_impl``, forward hooks included: traced, a hook's collectives and storage resizes would break the
        # graph or be baked into it. ``torch._dynamo.disable`` makes each hook a graph break that runs eagerly, so
        # the gather runs before the compiled forward sees the parameters and the free after it, wherever the
        # compiled module sits (a unit, a module holding units, a module inside a unit).
        eager = torch._dynamo.disable
        hooks = [  # [Note: unit lifecycle]: reads of sharded parameters inside the module's forward gather them
            self.module.register_forward_pre_hook(eager(self._enter_reads)),
            self.module.register_forward_hook(eager(self._exit_reads), always_call=True),
        ]
        for unit in self.units:
            pre_forward = eager(partial(self._pre_forward, unit))
            if unit.plan.name == ROOT:
                for _, m in root_owners(self.module, [unit.plan]):
                    hooks.append(m.register_forward_pre_hook(pre_forward, with_kwargs=True))
                continue
            m = self.module.get_submodule(unit.plan.name)
            hooks.append(m.register_forward_pre_hook(pre_forward, with_kwargs=True))
            hooks.append(m.register_forward_hook(eager(partial(self._post_forward, unit))))
        for unit in self.units:
            for p in unit.params:
                if p.requires_grad:
                    hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        return hooks

    # ------------------------------------------------------------ optimizer
    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """:meth:`attach_optimizers` of one optimizer."""
        self.attach_optimizers([optimizer])

    def attach_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Rebuild each optimizer (built over module parameters, each parameter in one of them) in place over the
        shards; state one already holds is sharded with it ([Note: state made before sharding] in
        ``lightning_zero/zero/optimizer_checks.py``). A segment holds the parameters of one param group of one
        optimizer."""
        for optimizer in optimizers:
            check_elementwise(optimizer, self.elementwise_optimizers)
        initial = [set_aside_state(optimizer) for optimizer in optimizers]
        key_of: dict[int, tuple[int, int]] = {}  # id(param) -> (optimizer, param group)
        for k, optimizer in enumerate(optimizers):
            for g, group in enumerate(optimizer.param_groups):
                check_disjoint([self._names.get(id(p), "?") for p in group["params"] if id(p) in key_of])
                key_of.update({id(p): (k, g) for p in group["params"]})
        unknown = [i for i in key_of if i not in self._names]
        if unknown:
            raise ValueError(f"the optimizer holds {len(unknown)} tensor(s) that are not module parameters")
        check_in_optimizer([n for n, p in self.module.named_parameters() if p.requires_grad and id(p) not in key_of])
        for unit in self.units:
            params = unit.params
            keys = [key_of[id(p)] if p.requires_grad else FROZEN for p in params]
            if keys != [s.key for s in unit.segments for _ in s.params]:
                self._resegment(unit, keys, params)
        self.optimizers = list(optimizers)
        self._held = [HeldPieces(optimizer) for optimizer in optimizers]
        self.original_groups_of = [[list(g["params"]) for g in optimizer.param_groups] for optimizer in optimizers]
        for k, optimizer in enumerate(optimizers):
            for g, group in enumerate(optimizer.param_groups):
                group["params"] = [s.shard for u in self.units for s in u.segments if s.key == (k, g)]
                if not group["params"]:
                    raise ValueError(f"param group {g} has no trainable parameters: drop the group or unfreeze some")
        for k, (optimizer, state) in enumerate(zip(optimizers, initial)):
            if state is not None:
                load_optimizer_state_dict(self, state, state["param_groups"], k)
            if isinstance(optimizer, ShardAware):  # [Note: shard-aware optimizers] in lightning_zero/optim/sharding.py
                optimizer.attach_sharding(Sharding(partial(self.total_grad_norm, optimizer), lambda: None))
            # [Note: zero_grad reaches the engine] in lightning_zero/optim/sharding.py
            restart_on_zero_grad(optimizer, partial(self.restart_window, optimizer))

    def _resegment(self, unit: Unit, keys: list[SegmentKey], params: list[nn.Parameter]) -> None:
        """Re-lay ``unit`` with one segment per key (one unit gathered at a time)."""
        values: dict[int, Tensor] = {}  # in the shards' dtype: master values are not rounded on the way
        for s in unit.segments:
            values.update(zip(map(id, s.params), s.gather_values(s.shard, self.group, tag="params")))
        self._build_segments(unit, keys, params)
        for s in unit.segments:
            for i, p in enumerate(s.params):
                s.load_param(i, values[id(p)])

    @property
    def segments(self) -> list[Segment]:
        return [s for u in self.units for s in u.segments]

    def step_nbytes(self) -> dict[str, int]:
        """Ledger bytes of one optimizer step of one micro-batch in theory, ``{"params": ..., "grads": ...}``
        ([Note: stage-3 traffic] in ``lightning_zero/zero/stage3/traffic.py``)."""
        segments = [
            SegmentTraffic(
                s.shard.numel(),
                gathers_per_step(unit.plan.name == ROOT, self.reshard_after_forward),
                s.key != FROZEN,
                s.gather_dtype.itemsize,
                (self.reduce_dtype or s.shard.dtype).itemsize,
            )
            for unit in self.units
            for s in unit.segments
        ]
        return step_nbytes(
            segments,
            self.world_size,
            weight_block_size=self.weight_block_size,
            grad_block_size=self.grad_block_size,
            hybrid=self.replicate_group is not None,
        )

    @property
    def shard_params(self) -> list[nn.Parameter]:
        return [s.shard for s in self.segments]

    @property
    def strategy_buffers(self) -> list[Tensor]:
        """Persistent tensors beyond shards, their gradients and optimizer state (unsharded flats: 0 bytes)."""
        persistent = [s.full for s in self.segments] + [s.grad_acc for s in self.segments if s.grad_acc is not None]
        return persistent + list(self._placeholders.tensors.values())

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for optimizer in self.optimizers:
            restart_on_zero_grad(optimizer, None)

    # ------------------------------------------------------------ outside a step ([Note: reading sharded parameters])
    @property
    def full_nbytes(self) -> int:
        """Bytes of every parameter, unsharded."""
        return sum(s.layout.numel * s.full.element_size() for s in self.segments)

    def detach_from_module(self) -> None:
        """The module holds its full weights again (``sharded_params_state.release``): hooks removed, no longer
        registered as sharded. The shards and the optimizer stay usable for a checkpoint."""
        self.remove()
        _ENGINES.pop(self.module, None)
        self.released = True

    def reading_placeholders(self) -> AbstractContextManager[None]:
        """Inside, ``state_dict()`` of the sharded module is allowed (for code that reads only keys and buffers)."""
        return self._guard.reading()
