"""Pure bucketing math: which tensors share a flat communication bucket, and where each one sits inside it.

Two rules: :func:`assign_buckets` packs tensors in a given order without ever exceeding the cap (the first layout of
every reducer), and :func:`buckets_by_arrival` is torch DDP's rule for the one rebuild after the first iteration
([Note: bucket rebuild] in ``lightning_zero/dp/reducer.py``), so that our rebuilt buckets hold the same tensors in
the same order as torch's.

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
    _check_lengths(numels, element_sizes, keys)
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

    return [_layout(key, members, numels) for members, key in zip(opened, bucket_keys)]


FIRST_BUCKET_CAP_BYTES = 2**20
"""Torch DDP's cap of the first rebuilt bucket under its default bucket size (``dist._DEFAULT_FIRST_BUCKET_BYTES``):
the gradients ready first start their all-reduce after 1 MiB instead of after a whole bucket."""


DEFAULT_BUCKET_SIZE_MB = 25
"""``bucket_size_mb``'s default, torch DDP's ``bucket_cap_mb`` default."""


def first_bucket_cap_bytes(bucket_size_mb: float) -> int:
    """The cap of the first bucket rebuilt by arrival order, torch DDP's rule: 1 MiB under the default bucket size,
    else the bucket size itself (torch caps every bucket alike once ``bucket_cap_mb`` is given)."""
    if bucket_size_mb == DEFAULT_BUCKET_SIZE_MB:
        return FIRST_BUCKET_CAP_BYTES
    return int(bucket_size_mb * 2**20)


def buckets_by_arrival(
    order: Sequence[int],
    numels: Sequence[int],
    element_sizes: Sequence[int],
    keys: Sequence[Hashable],
    first_cap_bytes: int,
    cap_bytes: int,
) -> list[BucketLayout]:
    """Torch DDP's rebuilt buckets (``compute_bucket_assignment_by_size`` with ``tensor_indices``): tensors taken in
    ``order`` (the order their gradients arrived), each key's open bucket *closed once it reaches* its cap (so a bucket
    may exceed the cap by its last tensor), the first bucket of each key capped at ``first_cap_bytes`` and every later
    one at ``cap_bytes``. Buckets come in the order they were closed, then the ones still open in the order they were
    opened (torch leaves that last order to a hash map; with one key, the common case, both are the opening order).
    ``indices`` are the callers' indices (``order``'s values), in arrival order.
    """
    if sorted(order) != list(range(len(numels))):
        raise ValueError(f"order must list every tensor index 0..{len(numels) - 1} once: got {list(order)}")
    _check_lengths(numels, element_sizes, keys)
    for name, cap in (("first_cap_bytes", first_cap_bytes), ("cap_bytes", cap_bytes)):
        if cap <= 0:
            raise ValueError(f"{name}={cap} is invalid: expected a positive number of bytes")

    closed: list[tuple[Hashable, list[int]]] = []
    open_members: dict[Hashable, list[int]] = {}  # per key, its open bucket; insertion order = opening order
    open_bytes: dict[Hashable, int] = {}
    closed_count: dict[Hashable, int] = {}
    for i in order:
        key = keys[i]
        open_members.setdefault(key, []).append(i)
        open_bytes[key] = open_bytes.get(key, 0) + numels[i] * element_sizes[i]
        if open_bytes[key] >= (cap_bytes if closed_count.get(key, 0) else first_cap_bytes):
            closed.append((key, open_members.pop(key)))
            del open_bytes[key]
            closed_count[key] = closed_count.get(key, 0) + 1
    closed += list(open_members.items())
    return [_layout(key, members, numels) for key, members in closed]


def _check_lengths(numels: Sequence[int], element_sizes: Sequence[int], keys: Sequence[Hashable]) -> None:
    if not len(numels) == len(element_sizes) == len(keys):
        raise ValueError(
            f"numels, element_sizes and keys must have one entry per tensor: got {len(numels)}, "
            f"{len(element_sizes)} and {len(keys)}"
        )


def _layout(key: Hashable, members: Sequence[int], numels: Sequence[int]) -> BucketLayout:
    offsets, total = [], 0
    for i in members:
        offsets.append(total)
        total += numels[i]
    return BucketLayout(key=key, indices=tuple(members), offsets=tuple(offsets), numel=total)
