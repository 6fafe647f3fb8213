"""ZeRO-3: an accumulation window of the shards' gradients, and what reads and ends it.

A window runs from the first backward after an optimizer step (or ``zero_grad``) to the next step: inside
:meth:`GradWindows.no_sync` its backward passes communicate nothing (``grad_sync="boundary"``); the gradient norm
reads every rank's shard gradients; :meth:`GradWindows.before_step` / :meth:`GradWindows.after_step` bracket an
optimizer's update and :meth:`GradWindows.restart_window` drops the window's gradients, as ``zero_grad`` does under
``ddp``. :class:`GradWindows` is a part of :class:`~lightning_zero.zero.stage3.engine.ShardedParams`, which holds the
state declared here.

[Note: unused parameters] With find_unused_parameters=True a unit that a rank did not (fully) use is reduced all the
same, its missing gradients as zeros, and every rank reduces the units in one fixed order (reverse unit order, roughly
the order backward finishes them): a unit whose turn has not come waits with its unsharded gradient. After the last
reduction one small all-reduce finds the parameters no rank used in the window; the optimizer step leaves those
untouched (lightning_zero/zero/unused.py), as torch DDP does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_zero.dp.unused import UsedParams
from lightning_zero.zero.grad_norm import clip_grad_norm_, total_grad_norm
from lightning_zero.zero.optimizer_checks import index_of
from lightning_zero.zero.stage3.segments import FROZEN, Segment, Unit
from lightning_zero.zero.unused import HeldPieces, ParamPieces, param_pieces


class GradWindows:
    """The accumulation windows of :class:`~lightning_zero.zero.stage3.engine.ShardedParams` and its optimizers."""

    group: Any
    rank: int
    device: torch.device
    units: list[Unit]
    optimizers: list[torch.optim.Optimizer]
    original_groups_of: list[list[list[nn.Parameter]]]
    require_backward_grad_sync: bool
    find_unused_parameters: bool
    _names: dict[int, str]
    _used: UsedParams
    _held: list[HeldPieces]

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
        return [s for u in self.units for s in u.segments if s.key != FROZEN and (k is None or s.key[0] == k)]

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
