"""ZeRO-3 storage: a unit's flat *segments* (shard, unsharded flat, gradients) and the unit's gather state.

See [Note: tensor roles] in ``lightning_zero/zero/stage3/engine.py`` for how the engine uses each tensor, and
[Note: flat layout] in ``lightning_zero/zero/partition.py`` for the layout math.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
from torch import Tensor, nn

from lightning_zero.comm import collectives as comm
from lightning_zero.zero.partition import flat_layout
from lightning_zero.zero.stage3.units import UnitPlan

SegmentKey = str | tuple[int, int]
"""Which parameters a segment holds: :data:`FROZEN` or :data:`TRAINABLE` ones, or one ``(optimizer, param group)``'s."""

FROZEN, TRAINABLE = "frozen", "trainable"
"""Segment keys before :meth:`~lightning_zero.zero.stage3.engine.ShardedParams.attach_optimizer` (after it,
trainable keys are ``(optimizer, param group)`` indices)."""


class UnitState(enum.Enum):
    SHARDED = "sharded"  # only shards exist; module parameters are placeholders
    GATHERING = "gathering"  # all-gathers in flight into the unsharded flats
    GATHERED = "gathered"  # module parameters are views of the unsharded flats


class Segment:
    """One flat buffer of a unit: its parameters of one key (optimizer param group, or frozen)."""

    def __init__(
        self,
        key: SegmentKey,
        params: list[nn.Parameter],
        names: list[str],
        world_size: int,
        rank: int,
        device: Any,
        module_dtype: torch.dtype,
        cast_dtype: torch.dtype | None = None,
        gather_dtype: torch.dtype | None = None,
        master_dtype: torch.dtype | None = None,
    ) -> None:
        """``module_dtype``: the parameters' dtype in the module as built; ``cast_dtype``: of the unsharded flat, the
        module computes with it; ``gather_dtype``: of the all-gather into it; ``master_dtype``: of the shard, which the
        optimizer updates and gradients accumulate in (``None``: the module's dtype for each)."""
        self.key, self.params, self.names = key, params, names
        self.layout = flat_layout([p.numel() for p in params], world_size)
        self.module_dtype = module_dtype  # a released module gets it back
        dtype = cast_dtype or self.module_dtype
        self.gather_dtype = gather_dtype or dtype
        self.start, self.end = self.layout.shard_range(rank)
        self.shard = nn.Parameter(torch.zeros(self.end - self.start, dtype=master_dtype or dtype, device=device))
        self.full = torch.empty(self.layout.padded_numel, dtype=dtype, device=device)
        self.views = [self.full.narrow(0, o, p.numel()).view(p.shape) for p, o in zip(params, self.layout.offsets)]
        self.full.untyped_storage().resize_(0)  # views first: they are checked against the storage's size
        self.grad_full: Tensor | None = None
        self.filled: list[bool] = []  # which parameters' gradients grad_full holds
        self.grad_acc: Tensor | None = None  # persistent storage of shard.grad (allocated at the first reduction)
        self._rank = rank

    def zero_unfilled(self) -> None:
        """Zero the parts of ``grad_full`` no gradient was copied into (unused parameters, padding)."""
        assert self.grad_full is not None
        for filled, p, offset in zip(self.filled, self.params, self.layout.offsets):
            if not filled:
                self.grad_full.narrow(0, offset, p.numel()).zero_()
        self.grad_full.narrow(0, self.layout.numel, self.layout.padded_numel - self.layout.numel).zero_()

    def gather_values(self, shard_tensor: Tensor, group: Any, tag: str = "state_dict") -> list[Tensor]:
        """All-gather a shard-shaped tensor (the shard, an optimizer state) and return full per-parameter views of
        the result, in its dtype (collective)."""
        flat = torch.empty(self.layout.padded_numel, dtype=shard_tensor.dtype, device=shard_tensor.device)
        comm.all_gather(flat, shard_tensor.detach(), group=group, tag=tag)
        return [flat.narrow(0, o, p.numel()).view(p.shape) for p, o in zip(self.params, self.layout.offsets)]

    @property
    def nbytes(self) -> int:
        return self.layout.padded_numel * self.full.element_size()

    def load_param(self, i: int, value: Tensor, target: Tensor | None = None) -> None:
        """Copy this rank's piece of parameter ``i`` (its full ``value``) into the shard (or a shard-shaped
        ``target``, e.g. an optimizer state)."""
        target = self.shard.data if target is None else target
        for index, in_param, in_shard, length in self.layout.param_pieces(self._rank):
            if index == i:
                target.narrow(0, in_shard, length).copy_(value.reshape(-1).narrow(0, in_param, length))


class Unit:
    def __init__(self, index: int, plan: UnitPlan) -> None:
        self.index, self.plan = index, plan
        self.segments: list[Segment] = []
        self.state = UnitState.SHARDED
        self.handles: list[comm.Handle | None] = []
        self.trainable: list[nn.Parameter] = []
        # Per pass ([Note: unit lifecycle] in lightning_zero/zero/stage3/backward.py):
        self.running = 0  # its forward is running (a read of its parameters there is its own)
        self.forwards = 0  # forwards with gradients enabled (recomputes inside backward not counted)
        self.inputs_pending = 0  # of those, forwards whose input gradients backward has yet to compute
        self.arrived: set[int] = set()  # ids of the trainable parameters whose gradients arrived
        self.done = False  # its backward completed: reduced (unless inside no_sync) and freed
        self.ready = False  # find_unused_parameters: completed, waiting for its turn to be reduced
        self.pinned = False  # kept gathered until the pass ends (read outside its forward, or create_graph)

    def end_pass(self) -> None:
        self.running = self.forwards = self.inputs_pending = 0
        self.arrived = set()
        self.done = self.ready = self.pinned = False

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for s in self.segments for p in s.params]
