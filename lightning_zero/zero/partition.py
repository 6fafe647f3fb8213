"""Pure ZeRO partition math: flat layouts, element-balanced shards, and the pieces of each that a rank owns.

[Note: flat layout] The trainable parameters of one optimizer param group are laid end to end, in registration
order, in one flat buffer of ``numel`` elements, padded with zeros to ``padded_numel``, a multiple of the world size
N. Rank r owns the contiguous slice ``[r*S, (r+1)*S)`` with ``S = padded_numel / N``, so shards differ by at most
the padding (< N elements) whatever the parameter sizes. Nothing here needs processes
(``tests/zero/test_partition.py``).

[Note: elementwise optimizers] A shard cuts tensors anywhere and the optimizer steps it as one 1-D tensor, so ZeRO
trains as ``ddp`` only with an optimizer whose update of each element depends on that element's parameter, gradient
and state alone (plus scalars such as the step count): SGD, Adam, AdamW and the rest of ``torch.optim`` but the four in
:data:`NOT_ELEMENTWISE`, which :func:`check_elementwise` refuses. Any other optimizer (from another package, the user's
own, or a ``torch.optim`` subclass with a ``step`` of its own) is refused too, naming its class: ZeRO cannot tell
whether its update is elementwise, and when it is not (a global gradient norm, as SAM's) the training differs from
``ddp`` with no other sign. The user declares the ones that are (``elementwise_optimizers={MyOptimizer}``); an
optimizer that needs global quantities implements [Note: shard-aware optimizers] in
``lightning_zero/optim/sharding.py`` (:class:`lightning_zero.optim.SAM` does).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from lightning_zero.optim.sharding import ShardAware

NOT_ELEMENTWISE: dict[type, str] = {
    torch.optim.LBFGS: "its step re-evaluates the closure and takes dot products over all parameters",
    torch.optim.Adafactor: "it factors the second moment of each matrix by rows and columns and scales by its RMS",
    torch.optim.Muon: "it orthogonalizes each weight matrix as a whole",
    torch.optim.SparseAdam: "it takes sparse gradients, and ZeRO reduces dense flat ones",
}
"""The ``torch.optim`` optimizers ZeRO refuses, and why ([Note: elementwise optimizers])."""


def shard_ranges(numel: int, world_size: int) -> dict[int, tuple[int, int]]:
    """``{rank: (start, end)}`` of a flat buffer of ``numel`` elements padded to a multiple of ``world_size``."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} is invalid: expected >= 1")
    if numel < 0:
        raise ValueError(f"numel={numel} is invalid: expected >= 0")
    shard = -(-numel // world_size)
    return {r: (r * shard, (r + 1) * shard) for r in range(world_size)}


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter of one param group sits in its flat buffer, and the shards of that buffer."""

    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    world_size: int

    @property
    def numel(self) -> int:
        """Elements of real parameters (no padding)."""
        return sum(self.numels)

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.world_size)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        return shard_ranges(self.numel, self.world_size)[rank]

    def owned(self, rank: int, start: int, end: int) -> tuple[int, int]:
        """The part of the flat range ``[start, end)`` that ``rank`` owns (empty: ``lo == hi``)."""
        shard_start, shard_end = self.shard_range(rank)
        lo, hi = max(start, shard_start), min(end, shard_end)
        return (lo, hi) if lo < hi else (lo, lo)

    def param_pieces(self, rank: int) -> list[tuple[int, int, int, int]]:
        """Pieces of parameters inside ``rank``'s shard: ``(param_index, offset_in_param, offset_in_shard, length)``."""
        shard_start, shard_end = self.shard_range(rank)
        pieces = []
        for i, (offset, numel) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(offset, shard_start), min(offset + numel, shard_end)
            if lo < hi:
                pieces.append((i, lo - offset, lo - shard_start, hi - lo))
        return pieces


def flat_layout(numels: Sequence[int], world_size: int) -> FlatLayout:
    """Lay parameters of ``numels`` elements end to end; shards per :func:`shard_ranges`."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} is invalid: expected >= 1")
    offsets, total = [], 0
    for numel in numels:
        offsets.append(total)
        total += numel
    return FlatLayout(numels=tuple(numels), offsets=tuple(offsets), world_size=world_size)


def torch_step(kind: type[torch.optim.Optimizer]) -> bool:
    """Whether optimizers of class ``kind`` step with a ``torch.optim`` class's own ``step``."""
    owner = next(c for c in kind.__mro__ if "step" in vars(c))
    return owner is not torch.optim.Optimizer and owner.__module__.startswith("torch.optim.")


def check_elementwise(optimizer: torch.optim.Optimizer, declared: Collection[type] = ()) -> None:
    """Raise unless ``optimizer`` steps elementwise as far as ZeRO can tell: a ``torch.optim`` step other than those
    of :data:`NOT_ELEMENTWISE`, a class in ``declared`` (the user's ``elementwise_optimizers``), or a shard-aware
    optimizer whose base optimizer passes ([Note: elementwise optimizers])."""
    if isinstance(optimizer, ShardAware):
        return check_elementwise(optimizer.base_optimizer, declared)
    kind = type(optimizer)
    for refused, why in NOT_ELEMENTWISE.items():
        if isinstance(optimizer, refused):
            raise ValueError(
                f"{kind.__name__} cannot be sharded by ZeRO: {why}, so each rank would step its shard differently"
                " from the whole model under ddp. Use it with ddp_scratch, or use an elementwise optimizer (SGD, Adam,"
                " AdamW, ...)"
            )
    if torch_step(kind) or any(issubclass(kind, c) for c in declared):
        return
    path = f"{kind.__module__}.{kind.__qualname__}"
    raise ValueError(
        f"{path} is not an optimizer ZeRO knows: ZeRO steps each rank's shard of the flattened parameters on its own,"
        " which trains as ddp only if the update of each element depends on that element alone (as SGD's and Adam's"
        f" do). If {kind.__name__}'s does, declare it: elementwise_optimizers={{{kind.__name__}}} (Hydra:"
        f" strategy.elementwise_optimizers=[{path}]). If it uses a global quantity (a gradient norm, as SAM does)"
        " or changes the weights between evaluations of the closure, use lightning_zero.optim.SAM or implement"
        " lightning_zero.optim.ShardAware, or train with ddp_scratch."
    )
