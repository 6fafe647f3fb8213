"""``zero1_scratch`` / ``zero2_scratch``: ZeRO on our own collectives (:mod:`lightning_zero.sharded_optimizer`).

Runbook::

    import lightning_zero  # registers the names below
    trainer = Trainer(accelerator="cpu", devices=2, strategy="zero2_scratch", gradient_clip_val=1.0)
    trainer = Trainer(devices=2, strategy=lightning_zero.ZeroStrategy(stage=1, grad_sync="microbatch"))

Registered names: ``zero1_scratch``, ``zero2_scratch`` (popen launcher) and their ``_spawn`` variants. The model is
not wrapped; the optimizer returned by ``configure_optimizers`` is rebuilt in place over this rank's shard after
Lightning sets it up, so schedulers keep driving it. Norm clipping (``gradient_clip_val`` with the default
``gradient_clip_algorithm="norm"``) uses the global norm across shards.

Checkpoints (``trainer.save_checkpoint`` is collective: call it on every rank, as Lightning's ``ModelCheckpoint`` does,
also after ``fit``; ``fit(ckpt_path=...)`` reads either kind, saved at any world size):

- ``state_dict_type="sharded"`` (default): a directory (:mod:`lightning_zero.checkpoint`); each rank writes its own
  optimizer shard through ``torch.distributed.checkpoint``, the replicated weights are written once.
- ``state_dict_type="full"``: one plain file from rank 0: full weights and the optimizer state gathered into the
  format of the unsharded optimizer, so it loads with plain ``torch.load`` or ``LightningModule.load_from_checkpoint``.
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

from lightning_zero.checkpoint import is_sharded_checkpoint, load_sharded, read_metadata, save_sharded
from lightning_zero.sharded_optimizer import GRAD_SYNC_MODES, ShardedOptimizer
from lightning_zero.strategies.base import ScratchParallelStrategy

STAGES = (1, 2, 3)
STATE_DICT_TYPES = ("sharded", "full")


class ZeroStrategy(ScratchParallelStrategy):
    """ZeRO data parallelism: optimizer state (stage 1) and gradients (stage 2) sharded across ranks.

    Args:
        stage: 1 (optimizer state sharded) or 2 (+ gradients). Stage 3 is not available yet.
        grad_sync: ``"boundary"`` (reduce once per optimizer step; full local gradients between micro-batches) or
            ``"microbatch"`` (reduce every micro-batch into the gradient shard). Default: ``"boundary"`` for stage 1,
            ``"microbatch"`` for stage 2.
        bucket_size_mb: cap of one gradient bucket in MiB (> 0).
        state_dict_type: ``"sharded"`` (a DCP directory, each rank writing its shard) or ``"full"`` (one plain file
            written by rank 0).
        **kwargs: see :class:`~lightning_zero.strategies.base.ScratchParallelStrategy`.
    """

    def __init__(
        self,
        stage: int = 2,
        grad_sync: str | None = None,
        bucket_size_mb: float = 25,
        state_dict_type: str = "sharded",
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
        self._restored_sharded = False

    @property
    def engine(self) -> ShardedOptimizer | None:
        """The ZeRO engine of the current (or last) fit, else ``None``."""
        return self._engine

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._setup_replicas(trainer)
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

    # ------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore into the flat buffers and the sharded optimizer, which exist only after setup."""
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizer shards itself

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's share of the optimizer state (collective: Lightning calls it on every rank when saving)."""
        if self._engine is None:
            return super().optimizer_state(optimizer)
        if self.state_dict_type == "sharded":
            return self._engine.sharded_state_dict()
        return self._engine.full_state_dict()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self.state_dict_type == "full":
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        checkpoint = dict(checkpoint)
        tensors: dict[str, Any] = {"model": checkpoint.pop("state_dict")}
        optimizer_states = checkpoint.pop("optimizer_states", [])
        for i, state in enumerate(optimizer_states):
            tensors[f"optimizer_{i}"] = {"state": state["state"]}
        checkpoint["optimizer_param_groups"] = [state["param_groups"] for state in optimizer_states]
        save_sharded(filepath, tensors, meta=checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.lightning_module is not None
        self._restored_sharded = is_sharded_checkpoint(checkpoint_path)
        if not self._restored_sharded:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
            if self._engine is not None and checkpoint.get("optimizer_states"):
                self._engine.load_full_state_dict(checkpoint["optimizer_states"][0])
            return checkpoint
        metadata = read_metadata(checkpoint_path)
        model_state = self.lightning_module.state_dict()  # views of the parameters: DCP loads in place
        for name, tensor in model_state.items():
            item = metadata.state_dict_metadata.get(f"model.{name}")
            if item is not None and tuple(item.size) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(item.size)}, but the model's has shape"
                    f" {tuple(tensor.shape)} (size mismatch): {checkpoint_path}"
                )
        tensors: dict[str, Any] = {"model": model_state}
        has_optimizer = any(fqn.startswith("optimizer_0.") for fqn in metadata.state_dict_metadata)
        if self._engine is not None and has_optimizer:
            tensors["optimizer_0"] = self._engine.sharded_template(metadata, "optimizer_0")
        meta = load_sharded(checkpoint_path, tensors)
        param_groups = meta.pop("optimizer_param_groups", [])
        if "optimizer_0" in tensors:
            self._engine.load_sharded_state_dict(tensors["optimizer_0"], param_groups[0])
        return meta

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        if not self._restored_sharded:  # a sharded checkpoint was loaded in place by load_checkpoint
            super().load_model_state_dict(checkpoint, strict)

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
