"""Pure ZeRO partition math: flat layouts, element-balanced shards, and the pieces of each that a rank owns.

[Note: flat layout] The trainable parameters of one optimizer param group are laid end to end, in registration
order, in one flat buffer of ``numel`` elements, padded with zeros to ``padded_numel``, a multiple of the world size
N. Rank r owns the contiguous slice ``[r*S, (r+1)*S)`` with ``S = padded_numel / N``, so shards differ by at most
the padding (< N elements) whatever the parameter sizes. Nothing here needs processes
(``tests/zero/test_partition.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
