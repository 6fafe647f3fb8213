"""``ddp_scratch``: data parallelism on our own bucketed all-reduce (:mod:`lightning_zero.reducer`).

Runbook::

    import lightning_zero  # registers the names below
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp_scratch", accumulate_grad_batches=4)

Registered names: ``ddp_scratch`` (popen launcher, like Lightning's ``ddp``), ``ddp_scratch_spawn``,
``ddp_scratch_find_unused_parameters_true``. The model is not wrapped: ``strategy.model`` is the LightningModule, and
gradients are averaged by autograd hooks. On the ``accumulate_grad_batches - 1`` non-boundary micro-batches of a
window Lightning enters :meth:`block_backward_sync`, and nothing is communicated at all.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from lightning_zero.reducer import GradientReducer
from lightning_zero.strategies.base import ScratchParallelStrategy


class ScratchDDPStrategy(ScratchParallelStrategy):
    """Data-parallel training with bucketed all-reduce overlapped with backward, written on torch.distributed.

    Args:
        bucket_size_mb: cap of one gradient bucket in MiB (> 0). 25 balances overlap against per-call overhead.
        **kwargs: see :class:`~lightning_zero.strategies.base.ScratchParallelStrategy` (``find_unused_parameters``,
            ``broadcast_buffers``, ``process_group_backend``, ``timeout``, ``start_method``, ...).
    """

    strategy_name = "ddp_scratch"

    def __init__(self, bucket_size_mb: float = 25, **kwargs: Any) -> None:
        if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float)) or bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb={bucket_size_mb!r} is invalid: expected a number of MiB > 0")
        super().__init__(**kwargs)
        self.bucket_size_mb = bucket_size_mb
        self._reducer: GradientReducer | None = None

    @property
    def reducer(self) -> GradientReducer | None:
        """The gradient engine while fitting, else ``None``."""
        return self._reducer

    @property
    @override
    def strategy_buffers(self) -> list[Tensor]:
        """The reducer's gradient buckets while fitting (gradients are views into them), else none."""
        return self._reducer.buffers if self._reducer is not None else []

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._setup_replicas(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._build_reducer()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _build_reducer(self) -> None:
        old = self._reducer
        self._reducer = GradientReducer.for_module(
            self.model,
            bucket_cap_bytes=int(self.bucket_size_mb * 2**20),
            find_unused_parameters=self.find_unused_parameters,
        )
        if old is not None:  # rebuilt inside a fit, maybe inside Lightning's no_sync window
            old.remove()
            self._reducer.require_backward_grad_sync = old.require_backward_grad_sync
        self._record_trainable()

    @override
    def _trainable_changed(self, names: list[str]) -> None:
        """Parameters unfrozen (or frozen) during the fit (``BackboneFinetuning``): rebuild the buckets over the
        trainable parameters now, so every one of them is averaged (torch DDP keeps its setup-time set, and ranks
        then step unfrozen parameters on their own gradients)."""
        self._build_reducer()

    @override
    def _engine_no_sync(self) -> AbstractContextManager:
        """Non-boundary micro-batches: accumulate locally, communicate nothing."""
        return self._reducer.no_sync() if self._reducer is not None else nullcontext()

    @override
    def teardown(self) -> None:
        if self._reducer is not None:
            self._reducer.remove()
            self._reducer = None
        self._revert_layer_sync()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        cls._register(strategy_registry, "ddp_scratch", "From-scratch bucketed DDP, popen launcher")
        cls._register(
            strategy_registry, "ddp_scratch_spawn", "From-scratch bucketed DDP, spawn launcher", start_method="spawn"
        )
        cls._register(
            strategy_registry,
            "ddp_scratch_find_unused_parameters_true",
            "From-scratch bucketed DDP allowing parameters without gradients",
            find_unused_parameters=True,
        )
