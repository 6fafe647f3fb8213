"""The gradient buffers a transient :class:`~lightning_zero.dp.reducer.GradientReducer` lends its buckets ([Note:
tensor roles] in ``lightning_zero/dp/reducer.py``).

Per (dtype, device) the pool holds at most :data:`POOL_SIZE` persistent buffers, each the size of the largest bucket,
allocated when first needed and reused every step: a transient reducer allocates nothing (and faults no pages) per
step, and at most two buckets of gradient exist at any time. Which bucket waits for which is the reducer's business
(it drains its oldest launched bucket while :meth:`BufferPool.can_lend` says no); the pool only keeps the buffers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from lightning_zero.dp.buckets import GradBucket

POOL_SIZE = 2
"""Pool buffers of a transient reducer: one bucket filling while the previous one is reduced."""

_Key = tuple[torch.dtype, torch.device]


def _key(bucket: GradBucket) -> _Key:
    return bucket.dtype, bucket.device


class BufferPool:
    """At most :data:`POOL_SIZE` buffers per (dtype, device) of ``buckets``, each the size of the largest bucket."""

    def __init__(self, buckets: Iterable[GradBucket]) -> None:
        self._pool: dict[_Key, list[Tensor]] = {}
        self._free: dict[_Key, list[Tensor]] = {}
        self._numel: dict[_Key, int] = {}
        for bucket in buckets:
            self._numel[_key(bucket)] = max(self._numel.get(_key(bucket), 0), bucket.numel)

    @property
    def buffers(self) -> list[Tensor]:
        """The buffers allocated so far."""
        return [t for pool in self._pool.values() for t in pool]

    def can_lend(self, bucket: GradBucket) -> bool:
        """Whether a pool buffer is free for ``bucket``, or one can still be allocated."""
        return bool(self._free.get(_key(bucket))) or len(self._pool.get(_key(bucket), [])) < POOL_SIZE

    def lend(self, bucket: GradBucket) -> Tensor:
        """A buffer for ``bucket``: a free pool buffer, a new one while the pool is not full, else a temporary one."""
        key = _key(bucket)
        pool, free = self._pool.setdefault(key, []), self._free.setdefault(key, [])
        if not free and len(pool) < POOL_SIZE:
            pool.append(torch.empty(self._numel[key], dtype=bucket.dtype, device=bucket.device))
            free.append(pool[-1])
        if free:
            return free.pop()
        # Both pool buffers hold buckets still filling (gradients arriving out of bucket order): a temporary one.
        return torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)

    def give_back(self, bucket: GradBucket) -> None:
        """``bucket`` is reduced and consumed: its buffer is free again (a temporary one is simply dropped)."""
        buffer = bucket.bound_buffer
        key = _key(bucket)
        self._free.setdefault(key, []).extend(b for b in self._pool.get(key, []) if b.data_ptr() == buffer.data_ptr())
