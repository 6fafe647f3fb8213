"""Trainable parameters without a gradient: the error when ``find_unused_parameters`` is off, and which parameters
were used in a backward pass, in an accumulation window, and on any rank (for ZeRO's handling, see
``lightning_zero/zero/unused.py``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_zero.comm import collectives as comm


def unused_error(names: Sequence[str]) -> RuntimeError:
    """The error for trainable parameters without a gradient when ``find_unused_parameters`` is off."""
    return RuntimeError(
        f"{len(names)} trainable parameter(s) received no gradient in this backward pass: {list(names)}. Make every"
        " parameter contribute to the loss, freeze the unused ones (requires_grad=False), or pass"
        " find_unused_parameters=True to the strategy."
    )


class UsedParams:
    """Which of some named parameters got a gradient in this backward pass and in this accumulation window, and which
    no rank used in the window."""

    def __init__(self, named: Sequence[tuple[str, Tensor]]) -> None:
        self.named = list(named)
        self._pass: set[int] = set()
        self._window: set[int] = set()
        self.unused_everywhere: set[str] = set()  # of the last find_unused_everywhere()

    def mark(self, p: Tensor) -> None:
        self._pass.add(id(p))
        self._window.add(id(p))

    def unused_in_pass(self) -> list[str]:
        return [name for name, p in self.named if id(p) not in self._pass]

    def unused_in_window(self) -> list[str]:
        return [name for name, p in self.named if id(p) not in self._window]

    def find_unused_everywhere(self, device: torch.device, group: Any = None) -> set[str]:
        """The window's parameters that no rank used (one small all-reduce; collective)."""
        used = torch.tensor([id(p) in self._window for _, p in self.named], dtype=torch.int32, device=device)
        if comm.world_size(group) > 1:
            comm.all_reduce(used, "max", group=group, tag="unused_map")
        self.unused_everywhere = {name for (name, _), flag in zip(self.named, used.tolist()) if not flag}
        return self.unused_everywhere

    def end_pass(self) -> None:
        self._pass.clear()

    def end_window(self, params: Iterable[Tensor] | None = None) -> None:
        """The window of ``params`` (``None``: of all) ends: their optimizer stepped, or was zeroed."""
        if params is None:
            self._window.clear()
        else:
            self._window.difference_update(id(p) for p in params)
