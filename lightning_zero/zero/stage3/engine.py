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
  reads a parameter outside its unit's forward and backward is visibly wrong ([Note: reading sharded parameters]).
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
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from lightning_zero.comm import collectives as comm
from lightning_zero.comm import quantized, watchdog
from lightning_zero.dp.buckets import dense_grad
from lightning_zero.dp.unused import UsedParams, unused_error
from lightning_zero.optim.sharding import ShardAware, Sharding, restart_on_zero_grad
from lightning_zero.zero.grad_norm import clip_grad_norm_, total_grad_norm
from lightning_zero.zero.optimizer_checks import (
    GRAD_SYNC_MODES,
    check_disjoint,
    check_in_optimizer,
    index_of,
    set_aside_state,
)
from lightning_zero.zero.partition import check_elementwise
from lightning_zero.zero.stage3.backward import (
    GatherOnRead,
    GraphTask,
    InputsDone,
    accumulates,
    current_task,
    grad_accumulator,
    grad_inputs,
    will_execute,
)
from lightning_zero.zero.stage3.gather_order import GatherOrder
from lightning_zero.zero.stage3.materialize import build_meta_modules, load_real_tensors
from lightning_zero.zero.stage3.segments import Segment, Unit, UnitState
from lightning_zero.zero.stage3.state import load_optimizer_state_dict
from lightning_zero.zero.stage3.traffic import SegmentTraffic, gathers_per_step, step_nbytes
from lightning_zero.zero.stage3.units import ROOT, plan_units, root_owners
from lightning_zero.zero.unused import HeldPieces, ParamPieces, param_pieces

FROZEN, TRAINABLE = "frozen", "trainable"
"""Segment keys before :meth:`ShardedParams.attach_optimizer` (after it, trainable keys are param group indices)."""

_ENGINES: weakref.WeakKeyDictionary[nn.Module, weakref.ref[ShardedParams]] = weakref.WeakKeyDictionary()
"""Module -> its engine (weak both ways: the module's hooks keep the engine alive as long as the module lives)."""

MAX_PENDING_REDUCTIONS = 1
"""Reduce-scatters left in flight while backward continues (each holds one unit's unsharded gradient)."""


class ShardedParams:
    """ZeRO-3 over ``module``: see the module docstring.

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
            [Note: unused parameters]. Off: such a parameter raises an error naming it.
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
        self._placeholders: dict[torch.dtype, Tensor] = {}
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
        self._order: list[int] = []  # units in the order this pass gathered them in forward
        self._last_order = [u.index for u in self.units]  # the previous pass's (prefetch guide)
        self._pending: list[tuple[Unit, Segment, Tensor, Tensor, comm.Handle | None]] = []
        self._cache: dict[tuple[int, torch.dtype], list[Tensor]] = {}  # transient buffers reused within a step
        self._reads_depth, self._read_mode = 0, None  # gathering_reads
        self._tasks: dict[int, GraphTask] = {}  # backward passes running ([Note: graph tasks])
        self._input_hooks: list[InputsDone] = []  # this pass's
        self.released, self._reading = False, False
        self._hooks = self._register_hooks()
        owners = {id(m): m for m in module.modules() if any(id(p) in self._where for p in m.parameters(recurse=False))}
        self._hooks += [m.register_state_dict_pre_hook(self._check_readable) for m in owners.values()]
        # [Note: unused parameters]
        self.find_unused_parameters = find_unused_parameters
        self._used = UsedParams([(name, p) for name, p in module.named_parameters() if p.requires_grad])
        self._reduce_order = [u for u in reversed(self.units) if u.trainable]
        self._accumulators = {id(p): grad_accumulator(p) for u in self.units for p in u.trainable}
        self._next_reduce = 0
        self._held: list[HeldPieces] = []  # per optimizer

    @staticmethod
    def of(module: nn.Module) -> ShardedParams | None:
        """The engine that shards ``module``, if any (its hooks and shards outlive a fit)."""
        ref = _ENGINES.get(module)
        return ref() if ref is not None else None

    # ------------------------------------------------------------ construction
    def _build_segments(self, unit: Unit, keys: list[int | str], params: list[nn.Parameter]) -> None:
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

    def _placeholder(self, p: Tensor, segment: Segment) -> Tensor:
        dtype = segment.full.dtype  # a parameter keeps the dtype it computes in, gathered or not
        if dtype not in self._placeholders:
            self._placeholders[dtype] = torch.full((), float("nan"), dtype=dtype, device=self.device)
        return self._placeholders[dtype].expand(p.shape)

    def shard_dtype(self, p: Tensor) -> torch.dtype:
        """The dtype ``p``'s values are kept in (its shard's: the master dtype under mixed precision)."""
        return self._where[id(p)][1].shard.dtype

    def _load_param(self, p: nn.Parameter) -> None:
        _, segment, i = self._where[id(p)]
        segment.load_param(i, p.data)
        p.data = self._placeholder(p, segment)

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

    # ------------------------------------------------------------ gather / free
    def _gather(self, unit: Unit) -> None:
        """Launch the unit's all-gathers (asynchronous)."""
        if unit.state is not UnitState.SHARDED or not unit.segments:
            return
        unit.handles = []
        self._gather_order.before_gather(unit.index)
        for s in unit.segments:
            s.full.untyped_storage().resize_(s.nbytes)
            unit.handles.append(self._all_gather(s))
        unit.state = UnitState.GATHERING

    def _all_gather(self, s: Segment) -> comm.Handle | None:
        """Launch the gather of ``s.shard`` into ``s.full``: exact in the gather dtype, or int8 blocks (qwZ)."""
        shard, kwargs = s.shard.detach(), {"group": self.group, "async_op": True, "tag": "params"}
        if self.weight_block_size is None:
            return comm.all_gather(s.full, shard, dtype=s.gather_dtype, **kwargs)
        return quantized.all_gather_quantized(s.full, shard, self.weight_block_size, dtype=s.gather_dtype, **kwargs)

    def _wait(self, unit: Unit) -> None:
        if unit.state is UnitState.GATHERING:
            self._wait_for(unit.handles, f"all-gather of unit {unit.plan.label!r}")
            unit.handles = []
            for s in unit.segments:
                for p, view in zip(s.params, s.views):
                    p.data = view
            unit.state = UnitState.GATHERED

    def _wait_for(self, handles: list[comm.Handle | None], what: str) -> None:
        try:
            with watchdog.doing(f"ZeRO-3 {what}"):
                for handle in handles:
                    if handle is not None:
                        handle.wait()
        except watchdog.CollectiveTimeout:  # names all of it already
            raise
        except RuntimeError as error:  # e.g. a peer gone, or the process group's timeout
            raise RuntimeError(
                f"{watchdog.describe(f'ZeRO-3 {what}')} failed on rank {self.rank}: another rank did not join it (if"
                " one reports a diverged collective sequence, that is the cause)"
            ) from error

    def _free(self, unit: Unit) -> None:
        if unit.state is UnitState.SHARDED:
            return
        self._wait(unit)
        for s in unit.segments:
            for p in s.params:
                p.data = self._placeholder(p, s)
            s.full.untyped_storage().resize_(0)
        unit.state = UnitState.SHARDED

    def gather_root(self) -> None:
        """Before a step: gather the root unit, whose parameters the step may use outside any module's forward (a
        LightningModule's own ``nn.Parameter``, an ``nn.ParameterList``), as if its first user's forward began. It
        stays gathered until its gradients are reduced, or until :meth:`reshard` after an evaluation step."""
        self._tasks.clear()  # of a backward that raised (its end never ran)
        root = self.units[0]
        if root.plan.name == ROOT and root.segments:
            self._pre_forward(root, self.module, (), {})

    def reshard(self) -> None:
        """Free every gathered unit and end the pass (after an evaluation step; by itself after each backward)."""
        self._end_unit_passes()
        self._free_all()
        self._gather_order.end_pass()

    def _free_all(self) -> None:
        for unit in self.units:
            self._free(unit)
        self._last_order, self._order = self._order or self._last_order, []

    @contextmanager
    def gathering_reads(self) -> Iterator[None]:
        """Inside, reading a sharded parameter outside its unit's forward gathers its unit and keeps it gathered until
        the pass ends (:class:`~lightning_zero.zero.stage3.backward.GatherOnRead`). The module's own forward runs
        inside it; the Trainer strategy runs each whole step inside it (``training_step`` may read parameters
        outside any forward)."""
        self._enter_reads()
        try:
            yield
        finally:
            self._exit_reads()

    def _enter_reads(self, *_: Any) -> None:
        self._reads_depth += 1
        if self._reads_depth == 1:
            self._read_mode = GatherOnRead(self._on_read, self._where)
            self._read_mode.__enter__()

    def _exit_reads(self, *_: Any) -> None:
        self._reads_depth -= 1
        if self._reads_depth == 0 and self._read_mode is not None:
            self._read_mode.__exit__(None, None, None)
            self._read_mode = None

    def _on_read(self, p: Tensor) -> None:
        unit = self._where[id(p)][0]
        if unit.running:  # its own forward
            return
        if unit.state is not UnitState.GATHERED:
            self._gather(unit)
            self._wait(unit)
        unit.pinned = True

    @contextmanager
    def summon_full_params(self) -> Iterator[None]:
        """Inside, every module parameter holds its full value (read-only: writes do not reach the shards)."""
        if self.released:
            yield
            return
        for unit in self.units:
            self._gather(unit)
            self._wait(unit)
        try:
            yield
        finally:
            self.reshard()

    # ------------------------------------------------------------ forward
    def _pre_forward(self, unit: Unit, module: nn.Module, args: Any, kwargs: Any) -> None:
        recompute = current_task() != -1  # activation checkpointing: a forward again inside backward
        if recompute:
            self._task().touched.add(unit.index)
        if unit.state is not UnitState.GATHERED:
            self._gather(unit)
            self._wait(unit)
            if not recompute:
                self._order.append(unit.index)
                position = len(self._order)
                if position < len(self._last_order):  # prefetch what ran next last time
                    self._gather(self.units[self._last_order[position]])
        if unit.plan.name != ROOT:
            unit.running += 1
        if recompute or not torch.is_grad_enabled():
            return
        unit.forwards += 1
        inputs = grad_inputs(args, kwargs) if unit.plan.name != ROOT else []
        if inputs:  # [Note: unit lifecycle]: complete only once these have their gradients
            unit.inputs_pending += 1
            self._input_hooks.append(InputsDone(inputs, partial(self._inputs_done, unit)))

    def _post_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        unit.running -= 1
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
        # A recompute inside backward ([Note: graph tasks]). Non-reentrant: backward runs through the graph of the
        # first forward. Reentrant (no graph recorded before): a nested backward runs through these outputs, so the
        # unit stays gathered for it (hooked as after a first forward) and is freed when that backward ends.
        if current_task() != -1 and (unit.forwards or not tensors):
            if self.reshard_after_forward and not unit.pinned:
                self._free(unit)
            return
        if torch.is_grad_enabled() and tensors:
            for t in tensors:
                t.register_hook(partial(self._pre_backward, unit))
            if not self.reshard_after_forward:
                return
        if not unit.pinned:
            self._free(unit)

    # ------------------------------------------------------------ backward ([Note: unit lifecycle])
    def _task(self) -> GraphTask:
        """The running backward pass, registered (with its end queued) at the first hook that sees it."""
        task_id = current_task()
        task = self._tasks.get(task_id)
        if task is None:
            nested = any(not t.nested for t in self._tasks.values())  # a reentrant backward inside another
            task = GraphTask(accumulates(list(self._accumulators.values())), torch.is_grad_enabled(), nested)
            self._tasks[task_id] = task
            torch.autograd.Variable._execution_engine.queue_callback(partial(self._end_task, task_id))
        return task

    def _pre_backward(self, unit: Unit, grad: Tensor) -> None:
        self._task().touched.add(unit.index)
        if unit.state is UnitState.GATHERED:
            return
        self._gather(unit)
        self._wait(unit)
        if unit.index in self._order:  # prefetch the unit that ran just before this one
            last = len(self._order) - 1 - self._order[::-1].index(unit.index)
            if last > 0 and not self.units[self._order[last - 1]].done:
                self._gather(self.units[self._order[last - 1]])

    def _inputs_done(self, unit: Unit) -> None:
        if self._task().accumulates:
            unit.inputs_pending -= 1
            self._maybe_complete(unit)

    def _on_grad(self, p: Tensor) -> None:
        if p.grad is None:
            return
        task = self._task()  # a model with a root unit only has no pre-backward hook
        unit, segment, i = self._where[id(p)]
        task.touched.add(unit.index)
        if not segment.shard.requires_grad:  # its optimizer is toggled off (toggle_optimizer): as if not computed
            p.grad = None
            unit.arrived.add(id(p))
            return self._maybe_complete(unit)
        if segment.grad_full is None:  # not zeroed: each gradient is copied in, gaps are zeroed before reducing
            segment.grad_full, segment.filled = self._take_grad_full(segment), [False] * len(segment.params)
        region = segment.grad_full.narrow(0, segment.layout.offsets[i], p.numel())
        if segment.filled[i]:
            region.add_(dense_grad(p.grad).reshape(-1))
        else:
            region.copy_(dense_grad(p.grad).reshape(-1))
        segment.filled[i] = True
        p.grad = None
        self._used.mark(p)
        unit.arrived.add(id(p))
        self._maybe_complete(unit)

    def _maybe_complete(self, unit: Unit) -> None:
        """Complete the unit's backward if nothing this pass computes still needs it ([Note: unit lifecycle])."""
        task = self._tasks.get(current_task())
        if task is None or not task.accumulates or task.nested or unit.done or unit.pinned or unit.inputs_pending > 0:
            return
        accumulators = self._accumulators
        if all(id(p) in unit.arrived or not will_execute(accumulators[id(p)]) for p in unit.trainable):
            self._complete(unit)

    def _complete(self, unit: Unit) -> None:
        unit.done = True
        if self.require_backward_grad_sync:
            if self.find_unused_parameters:
                unit.ready = True
                self._reduce_in_order()
            else:
                self._reduce(unit)
        if not unit.pinned:
            self._free(unit)

    def _reduce_in_order(self, finish: bool = False) -> None:
        """Reduce the ready units in the fixed order (all the rest too, as zeros where unused, with ``finish``)."""
        while self._next_reduce < len(self._reduce_order):
            unit = self._reduce_order[self._next_reduce]
            if not (unit.ready or finish):
                return
            self._reduce(unit)
            self._next_reduce += 1

    def _reduce(self, unit: Unit) -> None:
        """Launch the reduce-scatter of the unit's gradients (missing ones count as zeros)."""
        if any(s.grad_full is not None or (self.find_unused_parameters and s.key != FROZEN) for s in unit.segments):
            self._gather_order.before_reduce(unit.index)
        for s in unit.segments:
            if s.grad_full is None:
                if not self.find_unused_parameters or s.key == FROZEN:
                    continue
                s.grad_full, s.filled = self._take_grad_full(s), [False] * len(s.params)  # no gradient on this rank
            s.zero_unfilled()
            if s.grad_acc is None:
                s.grad_acc = torch.empty_like(s.shard)
            first = s.shard.grad is None and all(p[1] is not s for p in self._pending)  # of this window
            out = s.grad_acc if first else self._take(s.shard)
            self._pending.append((unit, s, out, s.grad_full, self._reduce_scatter(out, s.grad_full)))
            s.grad_full = None
        while len(self._pending) > MAX_PENDING_REDUCTIONS:
            self._finish_reduction()

    def _reduce_scatter(self, out: Tensor, grad_full: Tensor) -> comm.Handle | None:
        """Launch the average of ``grad_full`` over ranks into ``out``: exact in the reduce dtype, or int8 blocks
        reduced in fp32 (qgZ)."""
        kwargs = {"group": self.group, "async_op": True, "tag": "grads"}
        if self.grad_block_size is None:
            return comm.reduce_scatter(out, grad_full, "avg", dtype=self.reduce_dtype, **kwargs)
        return quantized.reduce_scatter_quantized(out, grad_full, self.grad_block_size, "avg", **kwargs)

    def _finish_reduction(self) -> None:
        unit, segment, out, grad_full, handle = self._pending.pop(0)
        self._wait_for([handle], f"gradient reduce-scatter of unit {unit.plan.label!r}")
        self._give(grad_full)
        if self.replicate_group is not None:  # hybrid: the shard group's average, averaged across the replicas
            dtype = None if self.grad_block_size is not None else self.reduce_dtype
            comm.all_reduce(out, "avg", group=self.replicate_group, tag="grads", dtype=dtype)
        if out is segment.grad_acc:
            segment.shard.grad = out
        else:
            segment.shard.grad.add_(out)
            self._give(out)

    def _take(self, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """An uninitialised buffer shaped like ``like`` (in ``dtype``), reused within a step: reallocating (and
        page-faulting) every unit's gradient buffers costs more than the communication they feed."""
        dtype = dtype or like.dtype
        free = self._cache.get((like.numel(), dtype), [])
        return free.pop() if free else torch.empty_like(like, dtype=dtype)

    def _take_grad_full(self, segment: Segment) -> Tensor:
        """An unsharded gradient buffer: full-sized, in the shard's dtype (gradients accumulate in it)."""
        return self._take(segment.full, segment.shard.dtype)

    def _give(self, buffer: Tensor) -> None:
        self._cache.setdefault((buffer.numel(), buffer.dtype), []).append(buffer)

    def _end_task(self, task_id: int) -> None:
        task = self._tasks.pop(task_id, None)
        if task is None:
            return
        if task.accumulates and not task.nested:
            return self._end_pass()
        for unit in (self.units[i] for i in sorted(task.touched)):
            if task.create_graph:  # the graph it built saved views of the unit's weights for a later backward
                unit.pinned = True
            elif not unit.pinned and unit.plan.name != ROOT:  # units are gathered again before their backward
                self._free(unit)

    def _end_pass(self) -> None:
        """The end of a backward pass that accumulated gradients: the units it left incomplete are reduced, then the
        pass's state goes."""
        try:
            sync = self.require_backward_grad_sync
            unused = self._used.unused_in_pass()
            if sync and unused and not self.find_unused_parameters:
                raise unused_error(unused)
            for unit in reversed(self.units):  # incomplete: an output no loss used, pinned, first-unit oddities
                if not unit.done:
                    self._complete(unit)
            if sync and self.find_unused_parameters:
                self._reduce_in_order(finish=True)
            if sync:  # gradients that arrived after their unit completed
                for unit in reversed(self.units):
                    if any(s.grad_full is not None for s in unit.segments if s.key != FROZEN):
                        self._reduce(unit)
            if sync and self.find_unused_parameters:
                self._used.find_unused_everywhere(self.device, self._job_group)
            while self._pending:
                self._finish_reduction()
        finally:
            self._end_unit_passes()
            self._used.end_pass()
            self._cache.clear()  # nothing unsharded survives the step
            self._free_all()
        self._gather_order.end_pass()  # not after an error: the other ranks may never reach theirs

    def _end_unit_passes(self) -> None:
        for unit in self.units:
            unit.end_pass()
        self._next_reduce = 0
        for hook in self._input_hooks:
            hook.remove()
        self._input_hooks = []

    # ------------------------------------------------------------ unused parameters
    # [Note: unused parameters] With find_unused_parameters=True a unit that a rank did not (fully) use is reduced all
    # the same, its missing gradients as zeros, and every rank reduces the units in one fixed order (reverse unit
    # order, roughly the order backward finishes them): a unit whose turn has not come waits with its unsharded
    # gradient. After the last reduction one small all-reduce finds the parameters no rank used in the window; the
    # optimizer step leaves those untouched (lightning_zero/zero/unused.py), as torch DDP does.
    @property
    def unused_everywhere(self) -> set[str]:
        """Parameters no rank used in the last synchronised window (with ``find_unused_parameters``)."""
        return self._used.unused_everywhere

    @property
    def param_pieces(self) -> list[ParamPieces]:
        """Every trainable parameter with its pieces in this rank's shard."""
        return self._pieces_of(None)

    def _pieces_of(self, optimizer: torch.optim.Optimizer | None) -> list[ParamPieces]:
        segments = self._segments_of(optimizer)
        return [p for s in segments for p in param_pieces(s.names, s.shard, s.layout, self.rank)]

    def before_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Between the last backward of a window and ``optimizer``'s update (``None``: every optimizer's): hold what
        no rank used."""
        if self.find_unused_parameters:
            for k, opt in enumerate(self.optimizers):
                if optimizer is None or opt is optimizer:
                    self._held[k].hold(self._pieces_of(opt), self.unused_everywhere)

    def after_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """After ``optimizer``'s update: put held pieces back; the accumulation window ends."""
        for k, opt in enumerate(self.optimizers):
            if optimizer is None or opt is optimizer:
                self._held[k].restore()
        self._used.end_window(p for s in self._segments_of(optimizer) for p in s.params)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside keep unsharded gradients and communicate nothing (``grad_sync="boundary"``)."""
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

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

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The (first) optimizer attached, if any."""
        return self.optimizers[0] if self.optimizers else None

    @property
    def original_groups(self) -> list[list[nn.Parameter]]:
        """Every attached optimizer's param groups as the user built them, in order."""
        return [group for groups in self.original_groups_of for group in groups]

    def _segments_of(self, optimizer: torch.optim.Optimizer | None) -> list[Segment]:
        """The trainable segments (of ``optimizer``; ``None``: of every optimizer)."""
        k = None if optimizer is None else index_of(self.optimizers, optimizer)
        return [s for s in self.segments if s.key != FROZEN and (k is None or s.key[0] == k)]

    def _resegment(self, unit: Unit, keys: list[int | str], params: list[nn.Parameter]) -> None:
        """Re-lay ``unit`` with one segment per key (one unit gathered at a time)."""
        values = {}  # in the shards' dtype: master values are not rounded on the way
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
        return persistent + list(self._placeholders.values())

    def clip_grad_norm_(self, max_norm: float, optimizer: torch.optim.Optimizer | None = None) -> Tensor:
        """Global-norm clipping over every rank's shard gradients (of ``optimizer``'s parameters)."""
        return clip_grad_norm_(self._pieces_of(optimizer), max_norm, **self._norm_arguments(optimizer))

    def total_grad_norm(self, optimizer: torch.optim.Optimizer | None = None) -> Tensor:
        """The 2-norm of the whole averaged gradient (of ``optimizer``'s parameters), as ``get_total_norm`` of the
        gradients under ``ddp`` (collective)."""
        return total_grad_norm(self._pieces_of(optimizer), **self._norm_arguments(optimizer))

    def _norm_arguments(self, optimizer: torch.optim.Optimizer | None) -> dict:
        if optimizer is None:
            groups = self.original_groups
        else:
            groups = self.original_groups_of[index_of(self.optimizers, optimizer)]
        order = [self._names[id(p)] for group in groups for p in group if p.requires_grad]
        return {"order": order, "unused": self.unused_everywhere, "group": self.group, "device": self.device}

    def restart_window(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Drop the gradients of this accumulation window (of ``optimizer``'s parameters), as ``zero_grad`` does
        under ``ddp``: the shard gradients, the unsharded ones ``grad_sync="boundary"`` keeps through a window, the
        record of what was used; the optimizer's ``zero_grad`` calls it ([Note: zero_grad reaches the engine] in
        ``lightning_zero/optim/sharding.py``)."""
        segments = self._segments_of(optimizer)
        for s in segments:
            s.shard.grad = s.grad_full = None
        self._used.end_window(p for s in segments for p in s.params)

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for optimizer in self.optimizers:
            restart_on_zero_grad(optimizer, None)

    # ------------------------------------------------------------ outside a step
    # [Note: reading sharded parameters] Outside its unit's forward and backward a module parameter is a placeholder
    # that reads as NaN. The root unit is gathered before each step (gather_root), for the parameters a step uses
    # outside any module's forward (a LightningModule's own); any other read (an L2 penalty over self.parameters()
    # after the forward) computes with NaN: ZeroStrategy stops a fit whose first loss is not finite, before its
    # backward, and warns about a logged metric that is NaN (lightning_zero/zero/stage3/placeholder_reads.py). A fit
    # that ends hands the full weights back (sharded_params_state.release, when they fit in memory), and until then a
    # state_dict() of a module holding placeholders raises instead of returning NaN.
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

    @contextmanager
    def reading_placeholders(self) -> Iterator[None]:
        """Inside, ``state_dict()`` of the sharded module is allowed (for code that reads only keys and buffers)."""
        previous, self._reading = self._reading, True
        try:
            yield
        finally:
            self._reading = previous

    def _check_readable(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        sharded = [
            name
            for name, p in module.named_parameters(recurse=False)
            if id(p) in self._where and self._where[id(p)][0].state is UnitState.SHARDED
        ]
        if sharded and not self._reading:
            raise RuntimeError(
                f"the parameters of {prefix.rstrip('.') or 'the module'} ({sharded}) are sharded by zero3_scratch: this"
                " rank holds placeholders that read as NaN. Read them inside"
                " `with trainer.strategy.engine.summon_full_params():` (on every rank), or save"
                " `trainer.save_checkpoint(path)`. After a fit the full weights come back into the module when they"
                " fit in memory (ZeroStrategy(model_init=...) decides)."
            )
