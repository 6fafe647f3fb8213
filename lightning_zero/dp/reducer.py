"""Bucketed gradient all-reduce overlapped with backward: the engine behind ``ddp_scratch``.

Runbook: ``GradientReducer.for_module(module, bucket_cap_bytes=25 * 2**20)`` registers one post-accumulate-grad hook
per trainable parameter. Run forward/backward as usual; when ``backward()`` returns every ``p.grad`` holds the gradient
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
- *accumulation bucket* (a bucket whose dtype differs from its parameters', e.g. fp32 buckets for bf16
  parameters under mixed precision): ``p.grad`` cannot be a view of another dtype, so the hook copies (or, later in an
  accumulation window, adds) each gradient into the view, casting it, and drops ``p.grad``. The gradient of ``p``
  then lives only in the bucket: :meth:`GradientReducer.grad_of` returns it.
- *transient bucket* (``transient=True``, ZeRO's gradient path): when the bucket's first gradient arrives it
  borrows one of two persistent *pool buffers* (each the size of the largest bucket; reused, so no allocation or
  page faults per step); once its all-reduce completes it is handed to ``on_reduced``, the members' ``.grad`` are
  dropped and the buffer goes back to the pool. When no buffer is free the oldest launched bucket is waited on
  first. So at most two buckets of gradient exist at any time.

[Note: launch order]
A bucket is *ready* when all its parameters' hooks have fired in the current synchronised backward. Buckets are
launched strictly in index order (a ready bucket waits for every earlier bucket to be launched), so every rank issues
the same sequence of all-reduces even if autograd finishes parameters in a different order on different ranks.
Buckets are first filled in reverse registration order, which is roughly the order backward produces gradients, so
the first buckets' all-reduces run while backward is still computing the rest. [Note: bucket rebuild] replaces that
guess by the order seen (in ``lightning_zero/dp/rebuild.py``).

States of one backward pass (``require_backward_grad_sync`` decides which one a pass runs in):
- ACCUMULATING (inside ``no_sync()``): hooks only keep ``p.grad`` bound to the view. No collective at all.
- REDUCING: hooks count ready parameters and launch buckets asynchronously; a callback queued on the autograd
  engine at the first hook runs when backward ends, waits for every bucket and resets the pass.

[Note: compressed buckets]
With a ``compressor`` (:class:`~lightning_zero.comm.powersgd.PowerSGDCompressor`, persistent buckets only) a bucket
launched while ``compressor.compressing`` is averaged by the compressor instead of the plain all-reduce: synchronously,
inside the launch (its handle is already finished). After the last bucket of every synchronised pass the compressor
counts one iteration, so passes inside ``no_sync()`` count nothing, as with torch DDP's ``no_sync``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from lightning_zero.comm import collectives as comm
from lightning_zero.comm import watchdog
from lightning_zero.comm.bucketing import assign_buckets
from lightning_zero.comm.powersgd import PowerSGDCompressor
from lightning_zero.dp.buckets import GradBucket, dense_grad, persistent_buckets
from lightning_zero.dp.buffer_pool import BufferPool
from lightning_zero.dp.rebuild import ArrivalRebuild
from lightning_zero.dp.unused import unused_error


class GradientReducer(ArrivalRebuild):
    """Averages gradients of ``params`` across ``group`` in buckets, overlapped with backward.

    Use :meth:`for_module` for data parallelism; ZeRO builds its own buckets over flat parameter groups.

    Args:
        params: trainable parameters, in expected gradient-ready order (reverse registration order).
        names: a name per parameter, for error messages.
        buckets: the buckets, in launch order; persistent buckets come with their buffer.
        transient: if ``True`` a bucket borrows a pool buffer when its first gradient arrives and returns it (dropping
            the members' ``.grad``) once reduced and handed to ``on_reduced``, so no full-size gradient lives through
            backward. If ``False`` (data parallelism) each bucket has its own buffer for the reducer's life and
            ``p.grad`` stays a view of it.
        on_reduced: called with each bucket once its all-reduce has completed (before a transient release).
        find_unused_parameters: if ``False``, a synchronised backward that leaves a trainable parameter without a
            gradient raises an error naming it. If ``True``, such parameters are reduced as zeros (every rank still
            launches every bucket, in order), and one small all-reduce per synchronised pass finds the parameters
            that got no gradient on *any* rank during the accumulation window (:attr:`unused_everywhere`); with
            persistent buckets they keep ``p.grad = None`` (so the optimizer skips them, as in single-process
            training). A persistent reducer's window ends with each synchronised pass; a transient one's when its
            owner calls :meth:`end_window` (after the optimizer step).
        group: process group (``None``: the default group).
        tag: ledger tag of the gradient all-reduces.
        reduce_dtype: the dtype the buckets are all-reduced in (``None``: their own); the result is cast back.
        compressor: averages the buckets instead of the plain all-reduce once it is ``compressing`` ([Note:
            compressed buckets]); persistent buckets only.
        reduce_bucket: launches a bucket's reduction instead of the all-reduce and returns its handle (ZeRO: each
            piece reduced into the rank that owns it; [Note: gradient reduction] in
            ``lightning_zero/zero/stage12_reduction.py``).
        ignored: ``ignored(p)`` says that ``p``'s gradient counts as not computed: its optimizer steps a stand-in
            (ZeRO's shard, a master) that ``LightningModule.toggle_optimizer`` turned off ([Note: toggled-off
            optimizers] in ``lightning_zero/optim/sharding.py``).
        rebuild_caps: ``(first_cap_bytes, cap_bytes)`` of the one rebuild by arrival order ([Note: bucket rebuild]);
            ``None``: the buckets stay as given.
        all_reduce_options: extra arguments of a bucket's all-reduce by its bytes (``algorithm``, ``ranks_per_node``).
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        names: Sequence[str],
        buckets: Sequence[GradBucket],
        *,
        transient: bool = False,
        on_reduced: Callable[[GradBucket], None] | None = None,
        find_unused_parameters: bool = False,
        group: Any = None,
        tag: str = "grads",
        reduce_dtype: torch.dtype | None = None,
        compressor: PowerSGDCompressor | None = None,
        reduce_bucket: Callable[[GradBucket], comm.Handle] | None = None,
        ignored: Callable[[Tensor], bool] | None = None,
        rebuild_caps: tuple[int, int] | None = None,
        all_reduce_options: Callable[[int], dict[str, Any]] | None = None,
    ) -> None:
        if compressor is not None and transient:
            raise ValueError(
                "gradient compression needs persistent buckets (transient=False): its error feedback is per bucket"
                " and outlives the pass"
            )
        self._params = list(params)
        self._names = list(names)
        self._buckets = list(buckets)
        self.transient = transient
        self.on_reduced = on_reduced
        self._pool = BufferPool(self._buckets)  # what a transient bucket borrows
        self.find_unused_parameters = find_unused_parameters
        self.group = group
        self.tag = tag
        self.reduce_dtype = reduce_dtype
        self.compressor = compressor
        self.reduce_bucket = reduce_bucket
        self._ignored = ignored
        self._options = all_reduce_options or (lambda nbytes: {})
        self.require_backward_grad_sync = True

        self._index_buckets()
        # Accumulation buckets ([Note: tensor roles]): the gradient is cast into the bucket, p.grad dropped.
        self._cast = [p.dtype != self._buckets[b].dtype for p, b in zip(self._params, self._bucket_of)]
        self._in_buffer = [False] * len(self._params)  # its gradient of this window is in its bucket's buffer
        for bucket in self._buckets:
            if bucket.buffer is not None:
                self._bind(bucket, bucket.buffer)
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._hooks = [
            p.register_post_accumulate_grad_hook(partial(self._on_grad_ready, i)) for i, p in enumerate(self._params)
        ]
        self._used = [False] * len(self._params)  # got a gradient in this accumulation window
        self.unused_everywhere: list[int] = []  # of the last synchronised pass's window, by index
        self._rebuild_caps = rebuild_caps
        # [Note: bucket rebuild]: the hooks' order in the first synchronised pass, while a rebuild is to come.
        rebuilds = rebuild_caps is not None and not transient and reduce_bucket is None and not find_unused_parameters
        self._arrival: list[int] | None = [] if rebuilds else None
        self._rebuilt = False
        self._reset_pass()

    def _index_buckets(self) -> None:
        """Where each parameter sits (bucket, slot), the compressor's view of each bucket, the watchdog's labels."""
        self._bucket_of = [0] * len(self._params)
        self._slot_of = [0] * len(self._params)
        for b, bucket in enumerate(self._buckets):
            for slot, i in enumerate(bucket.indices):
                self._bucket_of[i], self._slot_of[i] = b, slot
        # (offset, shape) of each bucket's members in buffer order: what the compressor views as its tensors.
        self._members = [
            sorted((offset, tuple(self._params[i].shape)) for i, offset in zip(b.indices, b.offsets))
            for b in self._buckets
        ]
        self._labels = {  # what a bucket's wait is, for the watchdog's messages
            id(b): f"gradient bucket {i} of {len(b.indices)} parameters ({self._names[b.indices[0]]}, ...)"
            for i, b in enumerate(self._buckets)
        }

    @classmethod
    def for_module(
        cls,
        module: nn.Module,
        *,
        bucket_cap_bytes: int,
        first_bucket_cap_bytes: int | None = None,
        grad_dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> GradientReducer:
        """Data parallelism: persistent buckets of at most ``bucket_cap_bytes`` over ``module``'s trainable
        parameters in reverse registration order (roughly the order backward produces their gradients), holding the
        gradients in ``grad_dtype`` (default: each parameter's dtype), rebuilt once by arrival order with a first
        bucket of ``first_bucket_cap_bytes`` (default: ``bucket_cap_bytes``) ([Note: bucket rebuild])."""
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad][::-1]
        params = [p for _, p in named]
        dtypes = [grad_dtype or p.dtype for p in params]
        keys = [(d, p.device) for d, p in zip(dtypes, params)]
        layouts = assign_buckets([p.numel() for p in params], [d.itemsize for d in dtypes], keys, bucket_cap_bytes)
        buckets = persistent_buckets(layouts, dtypes, params)
        caps = (first_bucket_cap_bytes or bucket_cap_bytes, bucket_cap_bytes)
        return cls(params, [name for name, _ in named], buckets, rebuild_caps=caps, **kwargs)

    # ------------------------------------------------------------------ public
    @property
    def buffers(self) -> list[Tensor]:
        """The persistent buffers: each bucket's (data parallelism) or the pool's (transient mode)."""
        return self._pool.buffers if self.transient else [b.bound_buffer for b in self._buckets]

    @property
    def buckets(self) -> list[GradBucket]:
        return list(self._buckets)

    @property
    def bucket_param_names(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [[self._names[i] for i in b.indices] for b in self._buckets]

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally and communicate nothing."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    @property
    def names(self) -> list[str]:
        """The parameters' names, in the order their indices refer to (:attr:`unused_everywhere`)."""
        return list(self._names)

    def grad_of(self, param: Tensor) -> Tensor | None:
        """Where ``param``'s gradient of this window is: ``param.grad``, or its accumulation bucket's view."""
        i = self._index[id(param)]
        if not self._cast[i]:
            return param.grad
        return self._view(i) if self._in_buffer[i] else None

    def end_window(self, indices: Iterable[int] | None = None) -> None:
        """The accumulation window of the parameters at ``indices`` (``None``: of all) is over (their optimizer
        stepped, or was zeroed): their next gradients start afresh. Transient reducers and accumulation buckets rely
        on it; plain buckets restart when ``p.grad`` is set to ``None``. With several optimizers each has a window
        of its own: one may step every micro-batch while another accumulates."""
        for i in range(len(self._params)) if indices is None else indices:
            self._used[i] = self._in_buffer[i] = False

    def indices_of(self, params: Iterable[Tensor]) -> list[int]:
        """The reducer's indices of ``params`` (those it reduces)."""
        return [self._index[id(p)] for p in params if id(p) in self._index]

    def remove(self) -> None:
        """Remove the autograd hooks; gradients stay where they are."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # ----------------------------------------------------------------- backward
    def _bind(self, bucket: GradBucket, buffer: Tensor) -> None:
        bucket.buffer = buffer
        bucket.views = []
        for i, offset in zip(bucket.indices, bucket.offsets):
            p = self._params[i]
            view = buffer.narrow(0, offset, p.numel()).view_as(p)
            if p.grad is not None:
                view.copy_(dense_grad(p.grad))
                p.grad = None if self._cast[i] else view
                self._in_buffer[i] = self._in_buffer[i] or self._cast[i]
            bucket.views.append(view)

    def _view(self, i: int) -> Tensor:
        bucket = self._buckets[self._bucket_of[i]]
        if bucket.buffer is None:  # transient: the first gradient of this bucket in this window
            buffer = self._borrow(bucket).narrow(0, 0, bucket.numel)
            members_end = max(o + self._params[j].numel() for j, o in zip(bucket.indices, bucket.offsets))
            buffer.narrow(0, members_end, bucket.numel - members_end).zero_()  # padding; members are copied in
            self._bind(bucket, buffer)
        return bucket.views[self._slot_of[i]]

    def _borrow(self, bucket: GradBucket) -> Tensor:
        while not self._pool.can_lend(bucket) and self._in_flight:
            self._drain(len(self._in_flight) - 1)  # the oldest launched bucket gives its buffer back
        return self._pool.lend(bucket)

    def _reset_pass(self) -> None:
        self._pending = [len(b.indices) for b in self._buckets]
        self._ready = [False] * len(self._params)
        self._next_launch = 0
        self._in_flight: list[tuple[GradBucket, comm.Handle]] = []
        self._callback_queued = False

    def _holds_grad(self, i: int) -> bool:
        """Whether parameter ``i``'s slice holds a gradient of this window (else it holds stale values)."""
        return self._in_buffer[i] if self.transient or self._cast[i] else self._params[i].grad is not None

    def _on_grad_ready(self, i: int, param: Tensor) -> None:
        if self._ignored is not None and self._ignored(param):
            self._check_ignored(i, param)
            return
        view = self._view(i)
        if self._cast[i]:  # an accumulation bucket: cast in, add within the window
            if param.grad is not None:  # else _view's binding of a borrowed buffer took it in already
                (view.add_ if self._in_buffer[i] else view.copy_)(dense_grad(param.grad).view_as(view))
                param.grad = None
        else:
            grad = param.grad
            assert grad is not None  # a post-accumulate-grad hook: autograd has just accumulated it
            if grad.is_sparse or grad.data_ptr() != view.data_ptr():
                view.copy_(dense_grad(grad))
                param.grad = view
        self._used[i] = self._in_buffer[i] = True
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
        if self._arrival is not None:
            self._arrival.append(i)
        self._pending[self._bucket_of[i]] -= 1
        self._launch_ready_buckets()

    def _check_ignored(self, i: int, param: Tensor) -> None:
        """An ignored parameter's gradient: nothing was accumulated if its owner turned ``requires_grad`` off for
        this backward ([Note: toggled-off optimizers] in ``lightning_zero/optim/sharding.py``); a fresh gradient of a
        backward it did not see is dropped; one added into its bucket's view cannot be taken out again."""
        if not param.requires_grad or param.grad is None:
            return
        bucket = self._buckets[self._bucket_of[i]]
        if bucket.buffer is not None and param.grad.data_ptr() == bucket.views[self._slot_of[i]].data_ptr():
            raise RuntimeError(
                f"parameter {self._names[i]!r} belongs to an optimizer toggled off (toggle_optimizer), but this"
                " backward added its gradient to the ones it accumulates: run the backward through the strategy"
                " (self.manual_backward(loss), fabric.backward(loss)), not loss.backward()"
            )
        param.grad = None

    def _launch_ready_buckets(self) -> None:
        # [Note: launch order]: never skip ahead of an unlaunched bucket.
        while self._next_launch < len(self._buckets) and self._pending[self._next_launch] == 0:
            b = self._next_launch
            bucket = self._buckets[b]
            compressor = self.compressor
            handle: comm.Handle | None
            if compressor is not None and compressor.compressing:  # [Note: compressed buckets]
                compressor.all_reduce(b, bucket.bound_buffer, self._members[b])
                handle = comm.Handle()
            elif self.reduce_bucket is not None:
                handle = self.reduce_bucket(bucket)
            else:
                buffer = bucket.bound_buffer
                options = self._options(buffer.numel() * (self.reduce_dtype or buffer.dtype).itemsize)
                handle = comm.all_reduce(
                    buffer, "avg", group=self.group, async_op=True, tag=self.tag, dtype=self.reduce_dtype, **options
                )
            assert handle is not None  # launched with async_op=True
            self._in_flight.append((bucket, handle))
            self._next_launch += 1
            if compressor is not None and self._next_launch == len(self._buckets):
                compressor.end_iteration()

    def _drain(self, keep: int) -> None:
        """Wait for the oldest launched buckets until at most ``keep`` remain; consume (and release) them."""
        while len(self._in_flight) > keep:
            bucket, handle = self._in_flight.pop(0)
            with watchdog.doing(self._labels.get(id(bucket), "a gradient bucket")):
                handle.wait()
            if self.on_reduced is not None:
                self.on_reduced(bucket)
            if self.transient:
                for i in bucket.indices:
                    self._params[i].grad = None
                    self._in_buffer[i] = False
                self._pool.give_back(bucket)
                bucket.buffer, bucket.views = None, []

    def _finish_pass(self) -> None:
        try:
            unready = [i for i, ready in enumerate(self._ready) if not ready]
            if unready and not self.find_unused_parameters:
                raise unused_error([self._names[i] for i in unready])
            if self.find_unused_parameters:
                # Every rank runs this, used or not, so the collective sequence stays identical across ranks.
                # A parameter "has a gradient" in this window as in single-process training: it was used, or it
                # still holds one from before. Unready slices that hold no gradient of this window are zeroed (a
                # persistent slice keeps an earlier window's values; a borrowed buffer holds anything).
                has_grad = [used or self._holds_grad(i) for i, used in enumerate(self._used)]
                for i in unready:
                    if not self._holds_grad(i):
                        self._view(i).zero_()
                self._pending = [0] * len(self._buckets)
                self._launch_ready_buckets()
                anywhere = torch.tensor(has_grad, dtype=torch.int32, device=self._buckets[0].device)
                comm.all_reduce(anywhere, "max", group=self.group, tag="unused_map")
                self.unused_everywhere = [i for i, flag in enumerate(anywhere.tolist()) if not flag]
            self._drain(0)
            if self._arrival is not None:
                self._rebuild_by_arrival()
            if self.find_unused_parameters and not self.transient:
                for i, p in enumerate(self._params):
                    if self._cast[i]:
                        self._in_buffer[i] = bool(anywhere[i])
                    else:
                        p.grad = self._view(i) if anywhere[i] else None
        finally:
            if not self.transient:
                self._used = [False] * len(self._params)
            if self._arrival is not None:  # a pass that raised: the next one records afresh
                self._arrival = []
            self._reset_pass()
