"""ZeRO-3: a unit's parameters gathered and freed ([Note: tensor roles] in ``lightning_zero/zero/stage3/engine.py``).

A unit is *sharded* (its module parameters are NaN placeholders), *gathering* (its all-gathers in flight into the
unsharded flats) or *gathered* (its module parameters are views of them). :class:`UnitGather` moves a unit between
those states; the engine's hooks decide when. Waiting names the collective a rank is stuck in (:func:`wait_for`), for
the gradient reduce-scatters too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_zero.comm import collectives as comm
from lightning_zero.comm import quantized, watchdog
from lightning_zero.zero.stage3.gather_order import GatherOrder
from lightning_zero.zero.stage3.segments import Segment, Unit, UnitState


def wait_for(handles: list[comm.Handle | None], what: str, rank: int) -> None:
    """Wait for ``handles``, the collectives of ``what``; a failure names it and this ``rank``."""
    try:
        with watchdog.doing(f"ZeRO-3 {what}"):
            for handle in handles:
                if handle is not None:
                    handle.wait()
    except watchdog.CollectiveTimeout:  # names all of it already
        raise
    except RuntimeError as error:  # e.g. a peer gone, or the process group's timeout
        raise RuntimeError(
            f"{watchdog.describe(f'ZeRO-3 {what}')} failed on rank {rank}: another rank did not join it (if"
            " one reports a diverged collective sequence, that is the cause)"
        ) from error


class Placeholders:
    """What a sharded module parameter holds: one NaN element of its dtype expanded to its shape (4 bytes, in-place
    writes fail), one element per dtype on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tensors: dict[torch.dtype, Tensor] = {}

    def of(self, p: Tensor, segment: Segment) -> Tensor:
        """The placeholder of ``p``, a parameter of ``segment``."""
        dtype = segment.full.dtype  # a parameter keeps the dtype it computes in, gathered or not
        if dtype not in self.tensors:
            self.tensors[dtype] = torch.full((), float("nan"), dtype=dtype, device=self.device)
        return self.tensors[dtype].expand(p.shape)


class UnitGather:
    """Gathers and frees units over ``group``: exactly in each segment's gather dtype, or as blockwise int8 blocks of
    ``weight_block_size`` elements (qwZ); every gather is first checked against the other ranks' order."""

    def __init__(
        self,
        group: Any,
        rank: int,
        weight_block_size: int | None,
        gather_order: GatherOrder,
        placeholders: Placeholders,
    ) -> None:
        self.group, self.rank = group, rank
        self.weight_block_size = weight_block_size
        self._gather_order = gather_order
        self._placeholders = placeholders

    def gather(self, unit: Unit) -> None:
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

    def wait(self, unit: Unit) -> None:
        if unit.state is UnitState.GATHERING:
            wait_for(unit.handles, f"all-gather of unit {unit.plan.label!r}", self.rank)
            unit.handles = []
            for s in unit.segments:
                for p, view in zip(s.params, s.views):
                    p.data = view
            unit.state = UnitState.GATHERED

    def gather_now(self, unit: Unit) -> None:
        """Gather ``unit`` and wait for it, unless it is gathered already."""
        if unit.state is not UnitState.GATHERED:
            self.gather(unit)
            self.wait(unit)

    def free(self, unit: Unit) -> None:
        if unit.state is UnitState.SHARDED:
            return
        self.wait(unit)
        for s in unit.segments:
            for p in s.params:
                p.data = self._placeholders.of(p, s)
            s.full.untyped_storage().resize_(0)
        unit.state = UnitState.SHARDED
