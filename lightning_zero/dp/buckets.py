"""A gradient bucket of :class:`~lightning_zero.dp.reducer.GradientReducer` (which parameters, where each sits in
its buffer), and the dense form a sparse gradient takes to enter one. The bucket plans themselves are pure math in
:mod:`lightning_zero.comm.bucketing`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_zero.comm.bucketing import BucketLayout


def dense_grad(grad: Tensor) -> Tensor:
    """``grad`` as a dense tensor: a sparse gradient (``nn.Embedding(sparse=True)``) enters the dense buckets and
    shards as its dense equal, so an optimizer that takes both (SGD, Adagrad) steps as under ``ddp``."""
    return grad.to_dense() if grad.is_sparse else grad


@dataclass
class GradBucket:
    """One bucket: its members (indices into the reducer's parameter list) and where each sits in the buffer.

    ``numel`` may exceed the members' total (ZeRO pads the last bucket of a flat group); the extra is zero.
    ``buffer`` is ``None`` while a transient bucket holds no gradient.
    """

    indices: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    dtype: torch.dtype
    device: torch.device
    buffer: Tensor | None = None
    views: list[Tensor] = field(default_factory=list)

    @property
    def bound_buffer(self) -> Tensor:
        """``buffer`` where one is bound: a persistent bucket's, or a transient one's from its first gradient until
        it is consumed."""
        assert self.buffer is not None, "a transient bucket without a gradient has no buffer"
        return self.buffer


def persistent_buckets(
    layouts: Sequence[BucketLayout], dtypes: Sequence[torch.dtype], params: Sequence[Tensor]
) -> list[GradBucket]:
    """A bucket with a zeroed buffer of its own per layout, in its members' gradient dtype (``dtypes``, by index) and
    on their device."""
    buckets = []
    for layout in layouts:
        first = layout.indices[0]  # every member shares the layout's key: its gradient dtype and device
        dtype, device = dtypes[first], params[first].device
        buffer = torch.zeros(layout.numel, dtype=dtype, device=device)
        buckets.append(GradBucket(layout.indices, layout.offsets, layout.numel, dtype, device, buffer))
    return buckets
