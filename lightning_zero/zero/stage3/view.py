"""What the state dicts (:mod:`lightning_zero.zero.stage3.state`) read of a ZeRO-3 engine: a structural type that
:class:`~lightning_zero.zero.stage3.engine.ShardedParams` satisfies.

The engine loads state its optimizers held before sharding through those state dicts ([Note: state made before
sharding] in ``lightning_zero/zero/optimizer_checks.py``), so the state dicts cannot name the engine's class
without an import cycle; they name this view of it instead.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from lightning_zero.zero.stage3.segments import Segment


class EngineView(Protocol):
    """The attributes and methods of a :class:`~lightning_zero.zero.stage3.engine.ShardedParams` its state dicts
    use."""

    module: nn.Module
    group: Any
    replicate_group: Any
    device: torch.device
    optimizers: list[torch.optim.Optimizer]
    original_groups_of: list[list[list[nn.Parameter]]]

    @property
    def segments(self) -> list[Segment]:
        """Every segment of every unit, frozen ones included."""
        ...

    def shard_dtype(self, p: Tensor) -> torch.dtype:
        """The dtype ``p``'s shard is kept in."""
        ...

    def detach_from_module(self) -> None:
        """Give the module its full weights back and stop sharding it."""
        ...

    def reading_placeholders(self) -> AbstractContextManager[None]:
        """Inside, ``state_dict()`` of the sharded module is allowed."""
        ...
