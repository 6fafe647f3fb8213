"""``ddp_scratch``: data parallelism on our own bucketed all-reduce (:mod:`lightning_zero.dp.reducer`).

Runbook::

    import lightning_zero  # registers the names below
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp_scratch", accumulate_grad_batches=4)

Registered names: ``ddp_scratch`` (popen launcher, like Lightning's ``ddp``), ``ddp_scratch_spawn``,
``ddp_scratch_find_unused_parameters_true``. The model is not wrapped: ``strategy.model`` is the LightningModule, and
gradients are averaged by autograd hooks. On the ``accumulate_grad_batches - 1`` non-boundary micro-batches of a
window Lightning enters :meth:`block_backward_sync`, and nothing is communicated at all.

Mixed precision ([Note: precision policy] in ``lightning_zero/training/precision.py``): under
``bf16-mixed``/``16-mixed`` the module stays in fp32 as under Lightning's ``ddp`` (its parameters are their own master);
under ``bf16-true``/ ``16-true`` (or with ``cast_module=True``) the optimizer steps fp32 master copies
(:class:`~lightning_zero.training.precision.MasterWeights`), gradients accumulate in fp32 buckets, and the checkpoint's
optimizer state carries each parameter's ``"master"``.

Gradient compression: ``grad_compression="powersgd"`` averages the buckets with PowerSGD
(:mod:`lightning_zero.comm.powersgd`) once ``start_iter`` optimizer steps have been all-reduced plainly. Checkpoints
(not weights-only ones) carry every rank's error feedback and Q memory under ``"powersgd_compressor"``, so a resume
is bit-identical; a checkpoint without that entry resumes with a fresh compressor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.comm.bucketing import DEFAULT_BUCKET_SIZE_MB, first_bucket_cap_bytes
from lightning_zero.comm.hierarchy import check_algorithm
from lightning_zero.comm.link_model import resolve_link_model
from lightning_zero.comm.powersgd_config import compression_config
from lightning_zero.dp.engine import DataParallelEngine
from lightning_zero.dp.reducer import GradientReducer
from lightning_zero.strategies.base import ScratchParallelStrategy
from lightning_zero.training.distributed import DDP_NAMES, check_bucket_size


class ScratchDDPStrategy(ScratchParallelStrategy):
    """Data-parallel training with bucketed all-reduce overlapped with backward, written on torch.distributed.

    Args:
        bucket_size_mb: cap of one gradient bucket in MiB (> 0). 25 balances overlap against per-call overhead.
        all_reduce_algorithm: ``"auto"`` (default), ``"native"``, ``"ring"`` or ``"hierarchical"``: how the buckets
            are all-reduced. ``"auto"`` takes the hierarchical all-reduce ([Note: hierarchical all-reduce] in
            ``lightning_zero/comm/hierarchy.py``) on gloo for the buckets the link model puts it faster for, when the
            job spans several nodes of several processes each, else the backend's own.
        link_model: the network's levels for ``"auto"`` ([Note: link model] in ``lightning_zero/comm/link_model.py``):
            a mapping of ``inter_node`` (and ``intra_node``) to ``alpha_s`` and ``beta_s_per_byte`` or ``bandwidth``,
            or the path of a ``lightning-zero-netlab --check --json`` file. ``None`` (default): the network lab's.
        grad_compression: ``None`` (the plain average) or ``"powersgd"``.
        powersgd: PowerSGD's options (:class:`~lightning_zero.comm.powersgd_config.PowerSGDConfig`: ``rank``,
            ``start_iter``, ``min_compression_rate``, ``warm_start``, ``error_feedback``, ``seed``,
            ``orthogonalization_epsilon``; torch's defaults), with ``grad_compression="powersgd"`` only. Not with a
            ``reduce_dtype`` other than ``"auto"``/``None``.
        **kwargs: see :class:`~lightning_zero.strategies.base.ScratchParallelStrategy` (``find_unused_parameters``,
            ``broadcast_buffers``, ``process_group_backend``, ``timeout``, ``start_method``, ...).
    """

    strategy_name = "ddp_scratch"
    registered_names = DDP_NAMES

    def __init__(
        self,
        bucket_size_mb: float = DEFAULT_BUCKET_SIZE_MB,
        grad_compression: str | None = None,
        powersgd: Mapping[str, Any] | None = None,
        all_reduce_algorithm: str = "auto",
        link_model: Any = None,
        **kwargs: Any,
    ) -> None:
        check_bucket_size(bucket_size_mb)
        check_algorithm(all_reduce_algorithm)
        self.link_model = resolve_link_model(link_model)
        super().__init__(**kwargs)
        self.bucket_size_mb = bucket_size_mb
        self.all_reduce_algorithm = all_reduce_algorithm
        self.compression = compression_config(
            grad_compression, powersgd, reduce_dtype=self._precision_settings["reduce_dtype"]
        )
        self._engine: DataParallelEngine | None = None  # of the current (or last) fit

    @property
    def reducer(self) -> GradientReducer | None:
        """The gradient engine while fitting, else ``None``."""
        return self._engine.reducer if self._engine is not None else None

    @property
    @override
    def strategy_buffers(self) -> list[Tensor]:
        """The reducer's gradient buckets while fitting (gradients are views into them) and the compressor's
        memories, else none."""
        return self._engine.strategy_buffers if self._engine is not None else []

    @override
    def model_state_params(self) -> list[Tensor]:
        """The module's parameters plus their fp32 master copies when the optimizer steps those."""
        pairs = self._engine.master_pairs if self._engine is not None else []
        return super().model_state_params() + [master for _, master in pairs]

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._setup_replicas(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            assert self.model is not None
            self._engine = DataParallelEngine(
                self.model,
                self.precision_policy,
                bucket_cap_bytes=int(self.bucket_size_mb * 2**20),
                first_bucket_cap_bytes=first_bucket_cap_bytes(self.bucket_size_mb),
                find_unused_parameters=self.find_unused_parameters,
                compression=self.compression,
                all_reduce_algorithm=self.all_reduce_algorithm,
                ranks_per_node=self.num_processes,
                link_model=self.link_model,
            )
            self._record_trainable()
            self.setup_optimizers(trainer)
            self._engine.attach_optimizers(self.optimizers)
        self._setup_precision(trainer, cast_module=fitting)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def _trainable_changed(self, names: list[str]) -> None:
        """Parameters unfrozen (or frozen) during the fit (``BackboneFinetuning``): rebuild the buckets over the
        trainable parameters now, so every one of them is averaged (torch DDP keeps its setup-time set, and ranks
        then step unfrozen parameters on their own gradients)."""
        assert self._engine is not None
        self._engine.rebuild_reducer()
        self._record_trainable()

    @override
    def _engine_no_sync(self) -> AbstractContextManager:
        """Non-boundary micro-batches: accumulate locally, communicate nothing."""
        return self.reducer.no_sync() if self.reducer is not None else nullcontext()

    @override
    def _engine_backward(self) -> AbstractContextManager:
        """With master weights: the parameters of toggled-off optimizers off (their masters are what is toggled)."""
        return self._engine.toggled_off() if self._engine is not None else nullcontext()

    # ------------------------------------------------------------ master weights
    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        engine = self._engine
        if engine is None or engine.masters_of(optimizer) is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_bind() -> Any:  # the optimizer runs the closure (the window's last backward) first
            output = closure()
            engine.before_step(optimizer)
            return output

        output = super().optimizer_step(optimizer, closure_then_bind, model, **kwargs)
        engine.after_step(optimizer)
        return output

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """The optimizer's state, with each parameter's fp32 ``"master"`` when master weights are kept."""
        state = super().optimizer_state(optimizer)
        if self._engine is not None:
            self._engine.add_masters_to_state(optimizer, state)
        return state

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._engine is not None:
            for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
                self._engine.load_masters_from_state(optimizer, state)
            self._engine.load_compressor_state(checkpoint)
        super().load_optimizer_state_dict(checkpoint)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """With compression, every rank's compressor state joins the checkpoint first (a collective: Lightning calls
        this on every rank); not in weights-only checkpoints."""
        if "optimizer_states" in checkpoint and self._engine is not None:
            checkpoint.update(self._engine.compressor_state())
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def teardown(self) -> None:
        if self._engine is not None:
            self._engine.remove()
        self._teardown_precision()
        self._revert_layer_sync()
        super().teardown()
