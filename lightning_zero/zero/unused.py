"""Parameters that no rank used in an optimizer step, under ZeRO: left untouched by that step, as torch DDP leaves them.

[Note: parameters no rank used] With ``find_unused_parameters=True``, torch DDP leaves the gradient of a parameter
that no rank used during the accumulation window at ``None``, so the optimizer skips it: no weight decay, no momentum,
no step count. ZeRO steps one flat *shard* per param group, in which such a parameter's *pieces* (the parts of it that
lie in this rank's shard) have a zero gradient, and a zero gradient is not a skipped one (AdamW still decays the
weight and moves its moments). So the engine *holds* those pieces before the step (their values, and the optimizer's
per-element state, or zeros where that state does not exist yet, which is what every ``torch.optim`` optimizer starts
it from) and puts them back after it.

What cannot be put back is per-shard scalar state such as Adam's ``step``: a parameter skipped in one step and used in
a later one would, under DDP, resume from its own smaller step count. That case is refused with an error naming the
parameter rather than trained differently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from lightning_zero.zero.partition import FlatLayout

Piece = tuple[int, int]
"""``(offset in the shard, length)``: a part of one parameter inside this rank's shard."""


class ParamPieces(NamedTuple):
    """One parameter's place under ZeRO: its name, the shard of its flat group (on this rank) and its pieces there."""

    name: str
    shard: Tensor
    pieces: list[Piece]
    numel: int


def param_pieces(names: Sequence[str], shard: Tensor, layout: FlatLayout, rank: int) -> list[ParamPieces]:
    """The parameters of one flat group (``names`` in layout order) with their pieces inside ``rank``'s shard."""
    pieces: list[list[Piece]] = [[] for _ in names]
    for index, _, in_shard, length in layout.param_pieces(rank):
        pieces[index].append((in_shard, length))
    return [ParamPieces(name, shard, own, numel) for name, own, numel in zip(names, pieces, layout.numels)]


def _per_element(value: object, shard: Tensor) -> bool:
    return isinstance(value, Tensor) and value.shape == shard.shape


class HeldPieces:
    """Holds the pieces of parameters that no rank used, across one optimizer step of ``optimizer``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._held: list[tuple[Tensor, int, int, Tensor, dict[str, Tensor]]] = []
        self._skipped: set[str] = set()  # names of parameters skipped by some earlier step

    def hold(self, params: Sequence[ParamPieces], unused: set[str]) -> None:
        """Before a step: keep the pieces of the ``unused`` parameters (by name) as they are, after checking that no
        used parameter was skipped by an earlier step of a shard that keeps a step count (the same answer on every
        rank: the names come from an all-reduce and every shard of a group has the same state keys)."""
        for param in params:
            if param.name not in unused and param.name in self._skipped and self._has_scalar_state(param.shard):
                raise RuntimeError(
                    f"parameter {param.name!r} gets a gradient again after optimizer steps in which no rank used it:"
                    " torch DDP would resume its own step count, but ZeRO keeps one step count per flat shard, so"
                    " its update would differ. Use the parameter in every step or freeze it (requires_grad=False),"
                    " or train this model with ddp_scratch"
                )
        self._held = []
        for param in params:
            if param.name not in unused:
                continue
            self._skipped.add(param.name)
            state = self.optimizer.state.get(param.shard, {})
            for offset, length in param.pieces:
                kept = {
                    k: v.narrow(0, offset, length).clone() for k, v in state.items() if _per_element(v, param.shard)
                }
                values = param.shard.detach().narrow(0, offset, length).clone()
                self._held.append((param.shard, offset, length, values, kept))

    def restore(self) -> None:
        """After the step: put the held pieces (values and per-element state) back."""
        with torch.no_grad():
            for shard, offset, length, values, kept in self._held:
                shard.narrow(0, offset, length).copy_(values)
                for key, value in self.optimizer.state.get(shard, {}).items():
                    if _per_element(value, shard):
                        target = value.narrow(0, offset, length)
                        target.copy_(kept[key]) if key in kept else target.zero_()
        self._held = []

    def _has_scalar_state(self, shard: Tensor) -> bool:
        state = self.optimizer.state.get(shard, {}).values()
        return any(isinstance(v, Tensor) and not _per_element(v, shard) for v in state)
