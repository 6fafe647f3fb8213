"""ZeRO-3: the gradient reduce path, from a unit's unsharded gradients to this rank's ``shard.grad``.

When a unit's backward completes ([Note: unit lifecycle] in ``lightning_zero/zero/stage3/backward.py``) each of its
trainable segments' unsharded gradient is reduce-scattered (average) into a shard-sized buffer, asynchronously: up to
:data:`MAX_PENDING_REDUCTIONS` stay in flight while backward goes on. Finishing one adds its result to ``shard.grad``
(hybrid sharding: after averaging it across the replicas). With ``find_unused_parameters`` units are reduced in one
fixed order instead ([Note: unused parameters] in ``lightning_zero/zero/stage3/windows.py``). The buffers are reused
within a step and dropped at its end.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_zero.comm import collectives as comm
from lightning_zero.comm import quantized
from lightning_zero.zero.stage3.gather import wait_for
from lightning_zero.zero.stage3.gather_order import GatherOrder
from lightning_zero.zero.stage3.segments import FROZEN, Segment, Unit

MAX_PENDING_REDUCTIONS = 1
"""Reduce-scatters left in flight while backward continues (each holds one unit's unsharded gradient)."""


class GradReducer:
    """Reduce-scatters the units' gradients over ``group`` (in ``reduce_dtype``, or as int8 blocks of
    ``grad_block_size`` elements reduced in fp32: qgZ), averaged across ``replicate_group`` too when given; every
    reduction is first checked against the other ranks' order."""

    def __init__(
        self,
        units: list[Unit],
        *,
        group: Any,
        rank: int,
        reduce_dtype: torch.dtype | None,
        grad_block_size: int | None,
        replicate_group: Any,
        find_unused_parameters: bool,
        gather_order: GatherOrder,
    ) -> None:
        self.group, self.rank, self.replicate_group = group, rank, replicate_group
        self.reduce_dtype, self.grad_block_size = reduce_dtype, grad_block_size
        self.find_unused_parameters = find_unused_parameters
        self._gather_order = gather_order
        self.pending: list[tuple[Unit, Segment, Tensor, Tensor, comm.Handle | None]] = []
        self.cache: dict[tuple[int, torch.dtype], list[Tensor]] = {}  # transient buffers reused within a step
        self._order = [u for u in reversed(units) if u.trainable]  # find_unused_parameters' fixed order
        self._next = 0

    def reduce(self, unit: Unit) -> None:
        """Launch the reduce-scatter of the unit's gradients (missing ones count as zeros)."""
        if any(s.grad_full is not None or (self.find_unused_parameters and s.key != FROZEN) for s in unit.segments):
            self._gather_order.before_reduce(unit.index)
        for s in unit.segments:
            if s.grad_full is None:
                if not self.find_unused_parameters or s.key == FROZEN:
                    continue
                s.grad_full, s.filled = self.take_grad_full(s), [False] * len(s.params)  # no gradient on this rank
            s.zero_unfilled()
            if s.grad_acc is None:
                s.grad_acc = torch.empty_like(s.shard)
            first = s.shard.grad is None and all(p[1] is not s for p in self.pending)  # of this window
            out = s.grad_acc if first else self._take(s.shard)
            self.pending.append((unit, s, out, s.grad_full, self._reduce_scatter(out, s.grad_full)))
            s.grad_full = None
        while len(self.pending) > MAX_PENDING_REDUCTIONS:
            self._finish_one()

    def reduce_in_order(self, finish: bool = False) -> None:
        """Reduce the ready units in the fixed order (all the rest too, as zeros where unused, with ``finish``)."""
        while self._next < len(self._order):
            unit = self._order[self._next]
            if not (unit.ready or finish):
                return
            self.reduce(unit)
            self._next += 1

    def restart_order(self) -> None:
        """A new pass reduces from the first unit of the fixed order again."""
        self._next = 0

    def _reduce_scatter(self, out: Tensor, grad_full: Tensor) -> comm.Handle | None:
        """Launch the average of ``grad_full`` over ranks into ``out``: exact in the reduce dtype, or int8 blocks
        reduced in fp32 (qgZ)."""
        kwargs = {"group": self.group, "async_op": True, "tag": "grads"}
        if self.grad_block_size is None:
            return comm.reduce_scatter(out, grad_full, "avg", dtype=self.reduce_dtype, **kwargs)
        return quantized.reduce_scatter_quantized(out, grad_full, self.grad_block_size, "avg", **kwargs)

    def finish(self) -> None:
        """Wait for every reduction in flight and add its result to ``shard.grad``."""
        while self.pending:
            self._finish_one()

    def _finish_one(self) -> None:
        unit, segment, out, grad_full, handle = self.pending.pop(0)
        wait_for([handle], f"gradient reduce-scatter of unit {unit.plan.label!r}", self.rank)
        self._give(grad_full)
        if self.replicate_group is not None:  # hybrid: the shard group's average, averaged across the replicas
            dtype = None if self.grad_block_size is not None else self.reduce_dtype
            comm.all_reduce(out, "avg", group=self.replicate_group, tag="grads", dtype=dtype)
        if out is segment.grad_acc:
            segment.shard.grad = out
        else:
            assert segment.shard.grad is not None  # set by this window's first reduction of the segment, done before
            segment.shard.grad.add_(out)
            self._give(out)

    def _take(self, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """An uninitialised buffer shaped like ``like`` (in ``dtype``), reused within a step: reallocating (and
        page-faulting) every unit's gradient buffers costs more than the communication they feed."""
        dtype = dtype or like.dtype
        free = self.cache.get((like.numel(), dtype), [])
        return free.pop() if free else torch.empty_like(like, dtype=dtype)

    def take_grad_full(self, segment: Segment) -> Tensor:
        """An unsharded gradient buffer: full-sized, in the shard's dtype (gradients accumulate in it)."""
        return self._take(segment.full, segment.shard.dtype)

    def _give(self, buffer: Tensor) -> None:
        self.cache.setdefault((buffer.numel(), buffer.dtype), []).append(buffer)
