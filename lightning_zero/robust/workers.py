"""Per-worker gradients of one rank: the rows a robust rule aggregates, and the batch split that feeds them.

A rank runs ``k = workers_per_rank`` *workers*: its micro-batch is split into ``k`` chunks
(:func:`split_batch`), each chunk gets its own forward and backward, and each backward accumulates into its own row
of a flat ``(k, d)`` buffer (:class:`WorkerGradients`). Global worker ``i`` is row ``i % k`` of rank ``i // k``, so
gathering every rank's rows in rank order gives the ``(n, d)`` stack of all ``n = k * world_size`` workers.

[Note: tensor roles]
- *worker rows*: ``(k, d)``, one flat row per worker over the trainable parameters in registration order. Before a
  worker's backward every ``p.grad`` is bound to ``p``'s slice of that worker's row; autograd accumulates into an
  existing ``.grad`` in place, so micro-batches of an accumulation window sum straight into the row. Zeroed when a
  window starts.
- *momentum rows*: ``(k, d)``, only with worker momentum ``beta > 0``: ``m <- beta * m + (1 - beta) * g`` per worker
  at each optimizer step, before aggregation (what each worker would send).
- *aggregate*: the ``(d,)`` result of the robust rule; at an optimizer step every ``p.grad`` is a view of it, so
  clipping and the optimizer see one ordinary gradient. Between steps ``p.grad`` is ``None``.

"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor

from lightning_zero.dp.unused import UsedParams


def split_batch(batch: Any, k: int) -> list[Any]:
    """Split every tensor of ``batch`` into ``k`` chunks along dim 0 (sizes differ by at most one); other leaves
    are shared. ``k == 1`` returns ``[batch]`` untouched.

    Chunks of unequal size weigh equally in the aggregate, so the mean over workers equals the mean over samples only
    when ``k`` divides the micro-batch.
    """
    if k == 1:
        return [batch]
    sizes = set()
    apply_to_collection(batch, Tensor, lambda t: sizes.add(t.shape[0] if t.ndim else None))
    if not sizes or None in sizes or len(sizes) != 1:
        raise ValueError(
            f"workers_per_rank={k} splits every tensor of the batch along dim 0, but the batch's tensors have leading"
            f" sizes {sorted(sizes, key=str)}: expected one common batch dimension"
        )
    (size,) = sizes
    if size < k:
        raise ValueError(f"workers_per_rank={k} needs at least {k} samples per micro-batch, got {size}")
    pieces = apply_to_collection(batch, Tensor, lambda t: _Chunks(torch.tensor_split(t, k, dim=0)))
    return [apply_to_collection(pieces, _Chunks, lambda c, j=j: c.parts[j]) for j in range(k)]


class _Chunks:
    """The chunks of one tensor; not a collection, so ``apply_to_collection`` stops at it."""

    def __init__(self, parts: Sequence[Tensor]) -> None:
        self.parts = parts


class WorkerGradients:
    """The ``(k, d)`` gradient rows of one rank's ``k`` workers over ``params`` (see [Note: tensor roles]).

    Args:
        params: the trainable parameters, in registration order (one dtype and device).
        workers: ``k``, the workers of this rank.
        momentum: worker momentum ``beta`` in ``[0, 1)``; 0 keeps no momentum rows.
        names: the parameters' names, for messages.
    """

    def __init__(
        self, params: Sequence[Tensor], workers: int, momentum: float = 0.0, names: Sequence[str] | None = None
    ) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("the module has no trainable parameters to aggregate")
        kinds = {(p.dtype, p.device) for p in self.params}
        if len(kinds) != 1:
            raise ValueError(f"robust aggregation needs one dtype and device for all trainable parameters, got {kinds}")
        ((dtype, device),) = kinds
        self.numel = sum(p.numel() for p in self.params)
        self.rows = torch.zeros(workers, self.numel, dtype=dtype, device=device)
        self.momentum = momentum
        self.momentum_rows = torch.zeros_like(self.rows) if momentum > 0 else None
        self._views = [self._views_of(row) for row in self.rows]
        # Which parameters got a gradient in the accumulation window (any worker): find_unused_parameters.
        self.used = UsedParams(list(zip(names or [str(i) for i in range(len(self.params))], self.params)))
        self._hooks = [p.register_post_accumulate_grad_hook(self.used.mark) for p in self.params]

    def remove(self) -> None:
        """Remove the autograd hooks that track which parameters got a gradient."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @property
    def numels(self) -> list[int]:
        """Each parameter's elements, in the rows' order."""
        return [p.numel() for p in self.params]

    @property
    def workers(self) -> int:
        return self.rows.shape[0]

    @property
    def buffers(self) -> list[Tensor]:
        """Persistent tensors beyond parameters, gradients and optimizer state."""
        return [self.rows] + ([self.momentum_rows] if self.momentum_rows is not None else [])

    def _views_of(self, flat: Tensor) -> list[Tensor]:
        return [part.view_as(p) for part, p in zip(flat.split([p.numel() for p in self.params]), self.params)]

    def bind(self, worker: int) -> None:
        """Point every ``p.grad`` at ``worker``'s row, so its backward accumulates there."""
        for p, view in zip(self.params, self._views[worker]):
            p.grad = view

    def collect(self, worker: int) -> None:
        """After ``worker``'s backward: keep any gradient autograd stored elsewhere (it replaces a ``.grad`` it
        cannot accumulate into in place, e.g. under ``create_graph=True``), then unbind every ``p.grad``."""
        with torch.no_grad():  # a create_graph gradient requires grad; its value is what the row keeps
            for p, view in zip(self.params, self._views[worker]):
                if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad.detach())
                p.grad = None

    def vectors(self) -> Tensor:
        """What the workers send at an optimizer step: the rows, or with momentum the updated momentum rows."""
        for worker in range(self.workers):
            self.vector(worker)
        return self.rows if self.momentum_rows is None else self.momentum_rows

    def vector(self, worker: int) -> Tensor:
        """What ``worker`` sends at an optimizer step (its momentum row updated, once per step; or its row)."""
        if self.momentum_rows is None:
            return self.rows[worker]
        return self.momentum_rows[worker].mul_(self.momentum).add_(self.rows[worker], alpha=1 - self.momentum)

    def set_grads(self, aggregate: Tensor, skip: set[str] = frozenset()) -> None:
        """Bind every ``p.grad`` to its slice of the ``(d,)`` aggregate (``None`` for the names in ``skip``)."""
        for (name, p), view in zip(self.used.named, self._views_of(aggregate.contiguous())):
            p.grad = None if name in skip else view
