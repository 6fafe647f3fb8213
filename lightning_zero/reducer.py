"""Bucketed gradient all-reduce overlapped with backward: the engine behind ``ddp_scratch``.

Runbook: ``GradientReducer(module, bucket_cap_bytes=25 * 2**20)`` registers one post-accumulate-grad hook per
trainable parameter. Run forward/backward as usual; when ``backward()`` returns every ``p.grad`` holds the gradient
averaged over the process group. Wrap micro-batches that must not communicate in ``with reducer.no_sync():``.

[Note: tensor roles]
- *bucket buffer*: one flat tensor per bucket (one dtype and device), allocated once and kept for the reducer's
  life. It is the only gradient storage: model-state bytes stay at params + grads + optimizer state (16Ψ for fp32
  AdamW), with no second bucket copy.
- *gradient view*: ``p.grad`` is a view of ``p``'s slice of its bucket buffer. autograd accumulates into an existing
  ``.grad`` in place, so micro-batches accumulate straight into the bucket.
- *fresh gradient*: after ``optimizer.zero_grad(set_to_none=True)`` (Lightning's default) ``p.grad`` is ``None`` and
  autograd hands the next gradient over as a new tensor. The hook copies it into the view and rebinds ``p.grad`` to
  the view; the fresh tensor dies at once. One copy per parameter per accumulation window, nothing persistent.

[Note: launch order]
A bucket is *ready* when all its parameters' hooks have fired in the current synchronised backward. Buckets are
launched strictly in index order (a ready bucket waits for every earlier bucket to be launched), so every rank issues
the same sequence of all-reduces even if autograd finishes parameters in a different order on different ranks.
Buckets are filled in reverse registration order, which is roughly the order backward produces gradients, so the
first buckets' all-reduces run while backward is still computing the rest.

States of one backward pass (``require_backward_grad_sync`` decides which one a pass runs in):
- ACCUMULATING (inside ``no_sync()``): hooks only keep ``p.grad`` bound to the view. No collective at all.
- REDUCING: hooks count ready parameters and launch buckets asynchronously; a callback queued on the autograd
  engine at the first hook runs when backward ends, waits for every bucket and resets the pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from lightning_zero import collectives as comm
from lightning_zero.bucketing import BucketLayout, assign_buckets


@dataclass
class _Bucket:
    layout: BucketLayout
    buffer: Tensor


class GradientReducer:
    """Averages gradients of ``module``'s trainable parameters across ``group`` in buckets, overlapped with backward.

    Args:
        module: the model; parameters with ``requires_grad=False`` are skipped.
        bucket_cap_bytes: bucket size cap in bytes.
        find_unused_parameters: if ``False``, a synchronised backward that leaves a trainable parameter without a
            gradient raises an error naming it. If ``True``, such parameters are reduced as zeros, and parameters
            that got no gradient on *any* rank during the accumulation window keep ``p.grad = None`` (so the
            optimizer skips them, as in single-process training). Costs one extra small all-reduce per step.
        group: process group (``None``: the default group).
        tag: ledger tag of the gradient all-reduces.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        bucket_cap_bytes: int,
        find_unused_parameters: bool = False,
        group: Any = None,
        tag: str = "grads",
    ) -> None:
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        named.reverse()  # gradients of the last layers are ready first
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self.find_unused_parameters = find_unused_parameters
        self.group = group
        self.tag = tag
        self.require_backward_grad_sync = True

        layouts = assign_buckets(
            [p.numel() for p in self._params],
            [p.element_size() for p in self._params],
            [(p.dtype, p.device) for p in self._params],
            bucket_cap_bytes,
        )
        self._buckets: list[_Bucket] = []
        self._bucket_of = [0] * len(self._params)
        self._views: list[Tensor] = [torch.empty(0)] * len(self._params)
        for b, layout in enumerate(layouts):
            dtype, device = layout.key
            buffer = torch.zeros(layout.numel, dtype=dtype, device=device)
            self._buckets.append(_Bucket(layout, buffer))
            for i, offset in zip(layout.indices, layout.offsets):
                p = self._params[i]
                self._views[i] = buffer.narrow(0, offset, p.numel()).view_as(p)
                self._bucket_of[i] = b
                if p.grad is not None:
                    self._views[i].copy_(p.grad)
                    p.grad = self._views[i]

        self._hooks = [
            p.register_post_accumulate_grad_hook(partial(self._on_grad_ready, i)) for i, p in enumerate(self._params)
        ]
        self._used = [False] * len(self._params)
        self._reset_pass()

    # ------------------------------------------------------------------ public
    @property
    def buffers(self) -> list[Tensor]:
        """The bucket buffers (the gradient storage), in launch order."""
        return [b.buffer for b in self._buckets]

    @property
    def bucket_param_names(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [[self._names[i] for i in b.layout.indices] for b in self._buckets]

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally and communicate nothing."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def remove(self) -> None:
        """Remove the autograd hooks; gradients stay where they are."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # ----------------------------------------------------------------- backward
    def _reset_pass(self) -> None:
        self._pending = [len(b.layout.indices) for b in self._buckets]
        self._ready = [False] * len(self._params)
        self._next_launch = 0
        self._handles: list[comm.Handle | None] = []
        self._callback_queued = False

    def _on_grad_ready(self, i: int, param: Tensor) -> None:
        view = self._views[i]
        if param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)
            param.grad = view
        self._used[i] = True
        if not self.require_backward_grad_sync:
            return
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_pass)
            self._callback_queued = True
        if self._ready[i]:
            raise RuntimeError(
                f"parameter {self._names[i]!r} received its gradient twice in one backward pass; reentrant"
                " activation checkpointing is not supported by the gradient reducer (use use_reentrant=False)"
            )
        self._ready[i] = True
        self._pending[self._bucket_of[i]] -= 1
        self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        # [Note: launch order]: never skip ahead of an unlaunched bucket.
        while self._next_launch < len(self._buckets) and self._pending[self._next_launch] == 0:
            buffer = self._buckets[self._next_launch].buffer
            self._handles.append(comm.all_reduce(buffer, "avg", group=self.group, async_op=True, tag=self.tag))
            self._next_launch += 1

    def _finish_pass(self) -> None:
        try:
            unready = [i for i, ready in enumerate(self._ready) if not ready]
            if unready and not self.find_unused_parameters:
                names = [self._names[i] for i in unready]
                raise RuntimeError(
                    f"{len(names)} trainable parameter(s) received no gradient in this backward pass: {names}."
                    " Make every parameter contribute to the loss, freeze the unused ones (requires_grad=False),"
                    " or pass find_unused_parameters=True to the strategy."
                )
            if self.find_unused_parameters:
                # Every rank runs this, used or not, so the collective sequence stays identical across ranks.
                # A parameter "has a gradient" in this window as in single-process training: it was used, or it
                # still holds one from before. The rest are reduced as zeros and keep grad=None if no rank has one.
                has_grad = [used or p.grad is not None for used, p in zip(self._used, self._params)]
                for i in unready:
                    if not has_grad[i]:
                        self._views[i].zero_()  # the slice holds an earlier window's gradient
                self._pending = [0] * len(self._buckets)
                self._launch_ready_buckets()
                anywhere = torch.tensor(has_grad, dtype=torch.int32, device=self._buckets[0].buffer.device)
                comm.all_reduce(anywhere, "max", group=self.group, tag="unused_map")
            for handle in self._handles:
                handle.wait()
            if self.find_unused_parameters:
                for i, p in enumerate(self._params):
                    p.grad = self._views[i] if anywhere[i] else None
        finally:
            self._used = [False] * len(self._params)
            self._reset_pass()
