"""ZeRO-3: the hooks that run each unit's life in a step ([Note: unit lifecycle] in
``lightning_zero/zero/stage3/backward.py``), and the end of a pass.

Forward gathers a unit before its forward (prefetching the unit that ran next in the previous pass) and frees it
after; backward gathers it again before its backward (prefetching the unit that ran before it), collects its
gradients, completes it when nothing the pass still computes needs it (its gradients reduced, the unit freed) and,
at the end of a pass that accumulated gradients, reduces what is left. Reads of sharded parameters outside a unit's
forward gather and pin that unit. :class:`UnitLifecycle` is a part of
:class:`~lightning_zero.zero.stage3.engine.ShardedParams`, which registers these hooks and holds the state declared
here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from lightning_zero.dp.buckets import dense_grad
from lightning_zero.dp.unused import UsedParams, unused_error
from lightning_zero.zero.stage3.backward import (
    GatherOnRead,
    GraphTask,
    InputsDone,
    accumulates,
    current_task,
    grad_inputs,
    will_execute,
)
from lightning_zero.zero.stage3.gather import UnitGather
from lightning_zero.zero.stage3.gather_order import GatherOrder
from lightning_zero.zero.stage3.reduce import GradReducer
from lightning_zero.zero.stage3.segments import FROZEN, Segment, Unit, UnitState
from lightning_zero.zero.stage3.units import ROOT


class UnitLifecycle:
    """The forward, backward and read hooks of :class:`~lightning_zero.zero.stage3.engine.ShardedParams`."""

    module: nn.Module
    device: torch.device
    units: list[Unit]
    reshard_after_forward: bool
    require_backward_grad_sync: bool
    find_unused_parameters: bool
    released: bool
    _where: dict[int, tuple[Unit, Segment, int]]
    _gathers: UnitGather
    _reducer: GradReducer
    _gather_order: GatherOrder
    _job_group: Any
    _order: list[int]
    _last_order: list[int]
    _reads_depth: int
    _read_mode: GatherOnRead | None
    _tasks: dict[int, GraphTask]
    _input_hooks: list[InputsDone]
    _used: UsedParams
    _accumulators: dict[int, Any]

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
            self._gathers.free(unit)
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
        self._gathers.gather_now(unit)
        unit.pinned = True

    @contextmanager
    def summon_full_params(self) -> Iterator[None]:
        """Inside, every module parameter holds its full value (read-only: writes do not reach the shards)."""
        if self.released:
            yield
            return
        for unit in self.units:
            self._gathers.gather_now(unit)
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
            self._gathers.gather(unit)
            self._gathers.wait(unit)
            if not recompute:
                self._order.append(unit.index)
                position = len(self._order)
                if position < len(self._last_order):  # prefetch what ran next last time
                    self._gathers.gather(self.units[self._last_order[position]])
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
                self._gathers.free(unit)
            return
        if torch.is_grad_enabled() and tensors:
            for t in tensors:
                t.register_hook(partial(self._pre_backward, unit))
            if not self.reshard_after_forward:
                return
        if not unit.pinned:
            self._gathers.free(unit)

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
        self._gathers.gather(unit)
        self._gathers.wait(unit)
        if unit.index in self._order:  # prefetch the unit that ran just before this one
            last = len(self._order) - 1 - self._order[::-1].index(unit.index)
            if last > 0 and not self.units[self._order[last - 1]].done:
                self._gathers.gather(self.units[self._order[last - 1]])

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
            segment.grad_full, segment.filled = self._reducer.take_grad_full(segment), [False] * len(segment.params)
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
                self._reducer.reduce_in_order()
            else:
                self._reducer.reduce(unit)
        if not unit.pinned:
            self._gathers.free(unit)

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
                self._gathers.free(unit)

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
                self._reducer.reduce_in_order(finish=True)
            if sync:  # gradients that arrived after their unit completed
                for unit in reversed(self.units):
                    if any(s.grad_full is not None for s in unit.segments if s.key != FROZEN):
                        self._reducer.reduce(unit)
            if sync and self.find_unused_parameters:
                self._used.find_unused_everywhere(self.device, self._job_group)
            self._reducer.finish()
        finally:
            self._end_unit_passes()
            self._used.end_pass()
            self._reducer.cache.clear()  # nothing unsharded survives the step
            self._free_all()
        self._gather_order.end_pass()  # not after an error: the other ranks may never reach theirs

    def _end_unit_passes(self) -> None:
        for unit in self.units:
            unit.end_pass()
        self._reducer.restart_order()
        for hook in self._input_hooks:
            hook.remove()
        self._input_hooks = []
