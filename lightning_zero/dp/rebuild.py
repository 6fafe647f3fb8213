"""The one rebuild of a data-parallel reducer's buckets by the order its gradients arrived, torch DDP's rule.

[Note: bucket rebuild]
Registration order is only a guess at the order gradients arrive: a module that registers its head first (or reuses a
layer) fills its reverse-registration buckets late, and less communication overlaps backward. So, as torch DDP does,
a reducer built with ``rebuild_caps`` (``for_module``: ``ddp_scratch``) records the order its parameters' hooks fire in
its first synchronised pass and, once that pass has drained, rebuilds its buckets once in that order with torch's
rule (:func:`~lightning_zero.comm.bucketing.buckets_by_arrival`: a small first bucket, so the first all-reduce starts
early). Rank 0's order is broadcast, so every rank builds the same buckets even if autograd ordered a rank's hooks
differently. The gradients of that pass move into the new buffers (``p.grad`` rebound to the new views), so the
optimizer step that follows sees them unchanged. As torch, no rebuild with ``find_unused_parameters`` (the order
changes from pass to pass), with transient buckets or a ``reduce_bucket`` (ZeRO's layouts are its shards'), or when a
compressor already holds per-bucket memories (``start_iter=0``: they belong to the first layout). Matching torch's
buckets exactly also gives PowerSGD torch's Q draws ([Note: compressed buckets]). :meth:`ArrivalRebuild.rebucket`
restores a saved order (a checkpoint's, so a resume keeps the layout its compressor memories belong to).

The rebuild is a part of :class:`~lightning_zero.dp.reducer.GradientReducer` (this mixin), kept here because it is one
concept of its own: the reducer calls :meth:`ArrivalRebuild._rebuild_by_arrival` once its first synchronised pass has
drained, while ``_arrival`` is a list.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_zero.comm import collectives as comm
from lightning_zero.comm.bucketing import buckets_by_arrival
from lightning_zero.comm.powersgd import PowerSGDCompressor
from lightning_zero.dp.buckets import GradBucket, persistent_buckets
from lightning_zero.dp.buffer_pool import BufferPool


class ArrivalRebuild:
    """The rebuild by arrival order of :class:`~lightning_zero.dp.reducer.GradientReducer` (its state is the
    reducer's)."""

    _params: list[Tensor]
    _names: list[str]
    _buckets: list[GradBucket]
    _cast: list[bool]
    _in_buffer: list[bool]
    _bucket_of: list[int]
    _pool: BufferPool
    _arrival: list[int] | None  # the hooks' order in the first synchronised pass, while a rebuild is to come
    _rebuilt: bool  # the buckets are no longer the first ones
    _rebuild_caps: tuple[int, int] | None
    transient: bool
    compressor: PowerSGDCompressor | None
    group: object

    # the reducer's methods this part calls
    _index_buckets: Callable[[], None]
    _bind: Callable[[GradBucket, Tensor], None]
    _view: Callable[[int], Tensor]
    _reset_pass: Callable[[], None]

    @property
    def rebuilt_order(self) -> list[str] | None:
        """The parameters' names in bucket order once the buckets were rebuilt (by arrival, or restored by
        :meth:`rebucket`); ``None`` while they are the first ones ([Note: bucket rebuild])."""
        return [self._names[i] for b in self._buckets for i in b.indices] if self._rebuilt else None

    def keep_layout(self) -> None:
        """No rebuild: the buckets stay as they are (a resumed compressor's memories belong to them)."""
        self._arrival = None

    def rebucket(self, names: Sequence[str]) -> None:
        """Rebuild the buckets in ``names``' order (a saved :attr:`rebuilt_order`) with the rebuild's caps; no
        further rebuild. Not a collective: every rank passes the same order."""
        position = {name: i for i, name in enumerate(self._names)}
        if sorted(names) != sorted(self._names):
            raise ValueError(
                f"the saved bucket order names {len(names)} parameters, this model's reducer has {len(self._names)}"
                f" ({sorted(set(names) ^ set(self._names))[:5]} differ): resume with the same trainable parameters"
            )
        self._rebucket([position[name] for name in names])

    def _rebuild_by_arrival(self) -> None:
        """[Note: bucket rebuild]: rank 0's arrival order of this pass, broadcast, then the rebuild."""
        assert self._arrival is not None
        if self.compressor is not None and self.compressor.buffers:  # its memories belong to these buckets
            self._arrival = None
            return
        seen = set(self._arrival)
        order = self._arrival + [i for b in self._buckets for i in b.indices if i not in seen]
        shared = torch.tensor(order, dtype=torch.int64, device=self._buckets[0].device)
        comm.broadcast(shared, comm.global_rank(0, self.group), group=self.group, tag="bucket_order")
        self._rebucket(shared.tolist())

    def _rebucket(self, order: Sequence[int]) -> None:
        """New persistent buckets over the parameters in ``order``; this window's gradients move along."""
        assert self._rebuild_caps is not None and not self.transient
        self._arrival, self._rebuilt = None, True
        held = {i: self._view(i) for i in range(len(self._params)) if self._cast[i] and self._in_buffer[i]}
        dtypes = [self._buckets[self._bucket_of[i]].dtype for i in range(len(self._params))]
        keys = [(d, p.device) for d, p in zip(dtypes, self._params)]
        numels = [p.numel() for p in self._params]
        layouts = buckets_by_arrival(order, numels, [d.itemsize for d in dtypes], keys, *self._rebuild_caps)
        self._buckets = persistent_buckets(layouts, dtypes, self._params)
        self._index_buckets()
        self._pool = BufferPool(self._buckets)
        for bucket in self._buckets:
            self._bind(bucket, bucket.bound_buffer)  # a p.grad view of the old buffer is copied and rebound
        for i, old in held.items():
            self._view(i).copy_(old)
        self._reset_pass()
