"""``zero1_scratch`` / ``zero2_scratch``: ZeRO on our own collectives (:mod:`lightning_zero.sharded_optimizer`).

Runbook::

    import lightning_zero  # registers the names below
    trainer = Trainer(accelerator="cpu", devices=2, strategy="zero2_scratch", gradient_clip_val=1.0)
    trainer = Trainer(devices=2, strategy=lightning_zero.ZeroStrategy(stage=1, grad_sync="microbatch"))

Registered names: ``zero1_scratch``, ``zero2_scratch`` (popen launcher) and their ``_spawn`` variants. The model is
not wrapped; the optimizer returned by ``configure_optimizers`` is rebuilt in place over this rank's shard after
Lightning sets it up, so schedulers keep driving it. Norm clipping (``gradient_clip_val`` with the default
``gradient_clip_algorithm="norm"``) uses the global norm across shards.

Checkpoints: ``trainer.save_checkpoint`` writes one plain file (``state_dict_type="full"``): full model weights and
the optimizer state gathered into the format of the unsharded optimizer, so it loads with plain ``torch.load`` or
``LightningModule.load_from_checkpoint`` and resumes at any world size. Gathering is collective: call
``trainer.save_checkpoint`` on every rank (as Lightning's ``ModelCheckpoint`` does), also after ``fit``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.sharded_optimizer import GRAD_SYNC_MODES, ShardedOptimizer
from lightning_zero.strategies.base import ScratchParallelStrategy, broadcast_module_states

STAGES = (1, 2, 3)
STATE_DICT_TYPES = ("full",)


class ZeroStrategy(ScratchParallelStrategy):
    """ZeRO data parallelism: optimizer state (stage 1) and gradients (stage 2) sharded across ranks.

    Args:
        stage: 1 (optimizer state sharded) or 2 (+ gradients). Stage 3 is not available yet.
        grad_sync: ``"boundary"`` (reduce once per optimizer step; full local gradients between micro-batches) or
            ``"microbatch"`` (reduce every micro-batch into the gradient shard). Default: ``"boundary"`` for stage 1,
            ``"microbatch"`` for stage 2.
        bucket_size_mb: cap of one gradient bucket in MiB (> 0).
        state_dict_type: ``"full"``: one plain checkpoint file written by rank 0.
        **kwargs: see :class:`~lightning_zero.strategies.base.ScratchParallelStrategy`.
    """

    def __init__(
        self,
        stage: int = 2,
        grad_sync: str | None = None,
        bucket_size_mb: float = 25,
        state_dict_type: str = "full",
        **kwargs: Any,
    ) -> None:
        if stage not in STAGES:
            raise ValueError(f"stage={stage!r} is invalid: expected 1, 2 or 3")
        if stage == 3:
            raise NotImplementedError("stage=3 (sharded parameters) is not available yet: use stage 1 or 2")
        if grad_sync is not None and grad_sync not in GRAD_SYNC_MODES:
            raise ValueError(f"grad_sync={grad_sync!r} is invalid: expected one of {GRAD_SYNC_MODES} or None")
        if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float)) or bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb={bucket_size_mb!r} is invalid: expected a number of MiB > 0")
        if state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(f"state_dict_type={state_dict_type!r} is invalid: expected one of {STATE_DICT_TYPES}")
        super().__init__(**kwargs)
        self.stage = stage
        self.grad_sync = grad_sync or ("boundary" if stage == 1 else "microbatch")
        self.bucket_size_mb = bucket_size_mb
        self.state_dict_type = state_dict_type
        self._engine: ShardedOptimizer | None = None

    @property
    def engine(self) -> ShardedOptimizer | None:
        """The ZeRO engine of the current (or last) fit, else ``None``."""
        return self._engine

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        broadcast_module_states(self.model)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ValueError(
                    f"ZeRO shards one optimizer: configure_optimizers returned {len(self.optimizers)}; combine them"
                    " into one optimizer with several param groups"
                )
            _optimizers_to_device(self.optimizers, self.root_device)
            self._engine = ShardedOptimizer(
                self.model,
                self.optimizers[0],
                stage=self.stage,
                grad_sync=self.grad_sync,
                bucket_cap_bytes=int(self.bucket_size_mb * 2**20),
            )
            # [Note: global-norm clipping] Lightning's Precision.clip_grad_by_norm takes the norm of the optimizer's
            # parameters' gradients, here this rank's shard only. Route it to the engine's global norm instead.
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm  # type: ignore[method-assign]
        self.setup_precision_plugin()

    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        assert self._engine is not None
        self._engine.clip_grad_norm_(float(clip_val))

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-boundary micro-batches: no communication with ``grad_sync="boundary"``; reduce anyway otherwise."""
        if self._engine is None or self.grad_sync == "microbatch":
            yield None
            return
        with self._engine.reducer.no_sync():
            yield None

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        assert self._engine is not None
        self._engine.after_step()
        return output

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The full optimizer state (collective: Lightning calls this on every rank when it saves)."""
        if self._engine is None:
            return super().optimizer_state(optimizer)
        return self._engine.full_state_dict()

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        if self._engine is None or len(states) != 1:
            return super().load_optimizer_state_dict(checkpoint)
        self._engine.load_full_state_dict(states[0])

    @override
    def teardown(self) -> None:
        # The engine (without its hooks) outlives the fit: the optimizer stays sharded, and a
        # ``trainer.save_checkpoint`` after ``fit`` must still gather the full optimizer state.
        if self._engine is not None:
            self._engine.remove()
            self.precision_plugin.__dict__.pop("clip_grad_by_norm", None)
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for stage in (1, 2):
            cls._register(strategy_registry, f"zero{stage}_scratch", f"From-scratch ZeRO stage {stage}", stage=stage)
            cls._register(
                strategy_registry,
                f"zero{stage}_scratch_spawn",
                f"From-scratch ZeRO stage {stage}, spawn launcher",
                stage=stage,
                start_method="spawn",
            )
