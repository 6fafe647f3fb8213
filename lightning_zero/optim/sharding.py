"""The protocol between a ZeRO engine and an optimizer whose step needs more than each element's own values.

[Note: shard-aware optimizers] ZeRO steps each rank's shard of the flattened parameters on its own, which trains as
``ddp`` only for an elementwise update ([Note: elementwise optimizers] in ``lightning_zero/zero/partition.py``). An
optimizer that needs a global quantity or changes the weights between two evaluations of the loss (SAM: the norm of
the whole gradient, then a step to ``w + e`` and back) can still be sharded if the engine supplies those: it
subclasses :class:`ShardAware`, and the engine that shards it calls :meth:`ShardAware.attach_sharding` with a
:class:`Sharding`. Under ``ddp`` (no engine) the optimizer holds the whole parameters and averaged gradients, and
computes everything itself. Its :attr:`ShardAware.base_optimizer` (the elementwise update it ends with) is checked
like any other optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sharding:
    """What a ZeRO engine gives a shard-aware optimizer. All three are collective: every rank calls them in the same
    order."""

    grad_norm: Callable[[], Tensor]
    """The 2-norm of the whole averaged gradient (each parameter's norm, then the norm of those, in the optimizer's
    order: ``torch.nn.utils.get_total_norm`` as under ``ddp``)."""
    params_changed: Callable[[], None]
    """After the optimizer wrote its parameters (the shards): make the module compute with the new values."""
    zero_grad: Callable[[], None]
    """Start a new accumulation of gradients (what ``zero_grad`` does to ``p.grad`` under ``ddp``)."""


class ShardAware(torch.optim.Optimizer):
    """An optimizer that ZeRO may shard although its step is not elementwise ([Note: shard-aware optimizers])."""

    base_optimizer: torch.optim.Optimizer
    """The elementwise optimizer whose update ends each step; it shares this optimizer's param groups and state."""
    sharding: Sharding | None = None
    """Set by the engine that shards this optimizer; ``None`` otherwise."""

    def attach_sharding(self, sharding: Sharding) -> None:
        self.sharding = sharding
