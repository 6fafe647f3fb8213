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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.dp.reducer import GradientReducer
from lightning_zero.strategies.base import ScratchParallelStrategy
from lightning_zero.training.precision import MasterWeights


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
        self._masters: dict[int, MasterWeights] = {}  # id(optimizer) -> its master copies
        self._master_dtype: torch.dtype | None = None

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
    def model_state_params(self) -> list[Tensor]:
        """The module's parameters plus their fp32 master copies when the optimizer steps those."""
        return super().model_state_params() + [m for masters in self._masters.values() for _, m in masters.pairs]

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._setup_replicas(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self._masters = {}
            originals = self._cast_params()
            self._build_reducer()
            self.setup_optimizers(trainer)
            if self._master_dtype is not None:
                self._masters = {id(o): MasterWeights(o, self._master_dtype, originals) for o in self.optimizers}
        self._setup_precision(trainer, cast_module=fitting)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _cast_params(self) -> dict[int, Tensor]:
        """Apply the precision policy to the parameters: cast to ``param_dtype`` (returning their values from
        before, for the masters) and decide whether the optimizer steps master copies."""
        policy, module = self.precision_policy, self.lightning_module
        assert module is not None
        originals = {}
        if policy.cast_dtype is not None:
            for p in module.parameters():
                if p.is_floating_point() and p.dtype != policy.cast_dtype:
                    originals[id(p)] = p.detach().clone()
                    p.data = p.data.to(policy.cast_dtype)
        low = {p.dtype for p in module.parameters() if p.requires_grad and policy.master(p.dtype) is not None}
        self._master_dtype = policy.master_dtype if low else None
        return originals

    def _build_reducer(self) -> None:
        old = self._reducer
        self._reducer = GradientReducer.for_module(
            self.model,
            bucket_cap_bytes=int(self.bucket_size_mb * 2**20),
            find_unused_parameters=self.find_unused_parameters,
            grad_dtype=self._master_dtype,  # masters: gradients accumulate in their dtype
            reduce_dtype=self.precision_policy.reduce_dtype,
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

    # ------------------------------------------------------------ master weights
    def _masters_of(self, optimizer: Any) -> MasterWeights | None:
        return self._masters.get(id(getattr(optimizer, "_optimizer", optimizer)))

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        masters, reducer = self._masters_of(optimizer), self._reducer
        if masters is None or reducer is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_bind() -> Any:  # the optimizer runs the closure (the window's last backward) first
            output = closure()
            masters.bind_grads(reducer.grad_of)
            return output

        output = super().optimizer_step(optimizer, closure_then_bind, model, **kwargs)
        masters.after_step()
        reducer.end_window()
        return output

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """The optimizer's state, with each parameter's fp32 ``"master"`` when master weights are kept."""
        state = super().optimizer_state(optimizer)
        masters = self._masters_of(optimizer)
        if masters is not None:
            masters.add_to_state_dict(state)
        return state

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
            masters = self._masters_of(optimizer)
            if masters is not None:
                masters.load_from_state_dict(state)
            else:  # a checkpoint of a run with masters: their values are the weights' exact ones
                params = [p for group in optimizer.param_groups for p in group["params"]]
                for number, p in enumerate(params):
                    master = state["state"].get(number, {}).pop("master", None)
                    if master is not None:
                        p.data.copy_(master)
        super().load_optimizer_state_dict(checkpoint)

    @override
    def teardown(self) -> None:
        if self._reducer is not None:
            self._reducer.remove()
            self._reducer = None
        if self.precision_policy.casts_module:
            for masters in self._masters.values():
                masters.restore_dtype()
        # The masters outlive the fit, as ZeRO's shards do: a checkpoint saved after fit carries them.
        self._teardown_precision()
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
