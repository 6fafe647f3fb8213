"""Pure bucketing math: which tensors share a flat communication bucket, and where each one sits inside it.

Nothing here touches torch.distributed or autograd, so it is unit-tested without processes
(``tests/comm/test_bucketing.py``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BucketLayout:
    """One bucket: the indices of its members (in the caller's order) and each member's element offset."""

    key: Hashable
    """What every member shares (e.g. ``(dtype, device)``): a bucket is one flat tensor."""
    indices: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int


def assign_buckets(
    numels: Sequence[int],
    element_sizes: Sequence[int],
    keys: Sequence[Hashable],
    cap_bytes: int,
) -> list[BucketLayout]:
    """Pack tensors into buckets of at most ``cap_bytes`` bytes, keeping the given order.

    Tensors are taken in order (the caller passes them in expected gradient-ready order, i.e. reverse registration
    order). Each ``key`` has one open bucket; a tensor that would overflow it closes the bucket and starts a new one.
    A tensor larger than the cap gets a bucket of its own. Buckets are returned in the order they were opened, so
    every rank derives the same sequence of collectives.

    Args:
        numels: element count of each tensor.
        element_sizes: bytes per element of each tensor.
        keys: what a bucket's members must share (dtype, device).
        cap_bytes: the bucket size cap in bytes, > 0.
    """
    if not len(numels) == len(element_sizes) == len(keys):
        raise ValueError(
            f"numels, element_sizes and keys must have one entry per tensor: got {len(numels)}, "
            f"{len(element_sizes)} and {len(keys)}"
        )
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes={cap_bytes} is invalid: expected a positive number of bytes")

    opened: list[list[int]] = []  # member indices per bucket, in opening order
    bucket_keys: list[Hashable] = []
    bucket_bytes: list[int] = []
    open_for_key: dict[Hashable, int] = {}
    for i, (numel, size, key) in enumerate(zip(numels, element_sizes, keys)):
        nbytes = numel * size
        b = open_for_key.get(key)
        if b is None or (bucket_bytes[b] > 0 and bucket_bytes[b] + nbytes > cap_bytes):
            b = len(opened)
            opened.append([])
            bucket_keys.append(key)
            bucket_bytes.append(0)
            open_for_key[key] = b
        opened[b].append(i)
        bucket_bytes[b] += nbytes

    layouts = []
    for members, key in zip(opened, bucket_keys):
        offsets, total = [], 0
        for i in members:
            offsets.append(total)
            total += numels[i]
        layouts.append(BucketLayout(key=key, indices=tuple(members), offsets=tuple(offsets), numel=total))
    return layouts
