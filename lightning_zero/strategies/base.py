"""The base of every lightning_zero strategy: processes, ranks, the process group and Lightning's collectives.

What a subclass inherits:

- **Launching** like Lightning's ``ddp`` (:mod:`lightning_zero.strategies.launcher`).
- **The process group** from Lightning's cluster environment, backend ``gloo`` on CPU and ``nccl`` on CUDA unless
  ``process_group_backend`` says otherwise.
- ``is_distributed = True``, so Lightning injects a ``DistributedSampler`` into every loader.
- ``reduce``/``all_gather``/``broadcast``/``barrier`` through :mod:`lightning_zero.comm.collectives`, which is what
  ``self.log(..., sync_dist=True)`` and ``trainer.strategy.reduce`` use.
- **Mixed precision as a property of the engine** ([Note: precision policy] in
  ``lightning_zero/training/precision.py``): ``param_dtype``/``reduce_dtype``/``master_weights``/``cast_module``,
  defaulted from the Trainer's ``precision``, and a loss scaler (``16-mixed``) whose inf/NaN check covers every rank.
- **Buffers as torch DDP keeps them** ([Note: buffer broadcast] below) and ``sync_batchnorm=True`` through
  :mod:`lightning_zero.training.sync_batchnorm`.
- **The process group torn down at exit** ([Note: process group torn down at exit] in
  ``lightning_zero/training/distributed.py``).

[Note: buffer broadcast] torch DDP (``DistributedDataParallel._pre_forward``/``_post_forward``) broadcasts rank 0's
buffers (BatchNorm running statistics) before a forward when ``broadcast_buffers`` is on and the *previous* forward
ran with gradients enabled outside ``no_sync``; it starts with that flag set. Lightning routes every
training/validation/test/predict step of a fit through the DDP wrapper's forward, and wraps nothing outside a fit.
Our strategies do the same around each step (:meth:`ScratchParallelStrategy._buffer_sync`), whatever their gradient
engine does, so buffers and every metric computed from them are those of ``ddp``: with ``accumulate_grad_batches=3``
the broadcast comes before the first micro-batch of each window, and a validation step right after a training step
broadcasts while the next training step does not.

Settings are validated when the strategy is built and again when the Trainer attaches the accelerator
(``_configure_launcher``), so a bad combination fails before any process starts.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from lightning_zero.comm import collectives as comm
from lightning_zero.comm import watchdog
from lightning_zero.strategies import trainable
from lightning_zero.strategies.launcher import SpawnLauncher
from lightning_zero.training import activation_checkpointing, faults
from lightning_zero.training.checkpoint_checks import check_shapes, reading, shapes_of
from lightning_zero.training.distributed import (
    DistributedPlumbing,
    broadcast_module_states,
)
from lightning_zero.training.memory import ModelStateBytes, model_state_bytes
from lightning_zero.training.precision import (
    DEFAULT,
    PrecisionPolicy,
)
from lightning_zero.training.sync_batchnorm import ScratchSyncBatchNorm

log = logging.getLogger(__name__)


class ScratchParallelStrategy(DistributedPlumbing, ParallelStrategy):
    """Multi-process, one-device-per-process strategy base: launching, process group and collectives.

    Args:
        accelerator: as in Lightning's ``DDPStrategy``; the Trainer fills it (and the next four) in.
        parallel_devices: the devices of this node's processes, one each.
        cluster_environment: where the processes and their ranks come from (``torchrun``, SLURM, ...).
        checkpoint_io: what writes and reads the checkpoint files.
        precision_plugin: the Trainer's ``precision`` as a plugin.
        process_group_backend: ``"gloo"``, ``"nccl"``, ``"mpi"`` or ``"ucc"``; default ``gloo`` on CPU and ``nccl``
            on CUDA.
        timeout: the process group's timeout (a ``timedelta`` or seconds): what bounds every collective that
            ``collective_timeout`` does not (barriers and checkpoint I/O, everything on NCCL).
        collective_timeout: seconds a training collective may wait for its peers (gloo; default 300) before every
            rank that can raise does, naming the collective, the unit or bucket, the step, and what the other ranks
            were waiting in ([Note: collective watchdog] in ``lightning_zero/comm/watchdog.py``). ``None``: only
            ``timeout`` bounds it.
        start_method: ``"popen"`` (default), ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        find_unused_parameters: allow trainable parameters that get no gradient in a backward pass, as torch DDP's
            option of that name: they are averaged as zeros where a rank did not use them, and a parameter no rank
            used in an optimizer step is left untouched by that step (its gradient stays ``None``). Off (default): such
            a parameter raises an error naming it.
        broadcast_buffers: re-broadcast rank 0's buffers as torch DDP does ([Note: buffer broadcast]).
        param_dtype: the dtype parameters are communicated and computed in: ``"bf16"``, ``"fp16"``, ``"fp32"``, a torch
            dtype, ``None`` (the module's own dtype) or ``"auto"`` (default: from the Trainer's ``precision``); see
            [Note: precision policy] in ``lightning_zero/training/precision.py``.
        reduce_dtype: the dtype gradients are averaged in across ranks; the same choices as ``param_dtype``.
        master_weights: under low precision, let the optimizer update fp32 master copies (default) instead of the
            low-precision parameters themselves.
        cast_module: under ``-mixed``, keep the module's parameters and floating-point buffers in the low-precision
            dtype and cast floating-point inputs to it (DeepSpeed's ``bf16``/``fp16`` mode; half the parameter
            memory). Needs a module whose forward never mixes that dtype with float32 tensors of its own.
        activation_checkpointing_policy: module classes whose instances recompute their forward in backward instead
            of keeping their activations (``lightning_zero/training/activation_checkpointing.py``), as Lightning's FSDP
            strategy takes it; during fits.
    """

    strategy_name = "scratch"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        collective_timeout: timedelta | float | None = watchdog.DEFAULT_TIMEOUT,
        start_method: str = "popen",
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        param_dtype: str | torch.dtype | None = DEFAULT,
        reduce_dtype: str | torch.dtype | None = DEFAULT,
        master_weights: bool = True,
        cast_module: bool = False,
        activation_checkpointing_policy: set[type] | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._init_settings(
            process_group_backend=process_group_backend,
            timeout=timeout,
            collective_timeout=collective_timeout,
            start_method=start_method,
            find_unused_parameters=find_unused_parameters,
            broadcast_buffers=broadcast_buffers,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            master_weights=master_weights,
            cast_module=cast_module,
            activation_checkpointing_policy=activation_checkpointing_policy,
        )
        self._checkpointed: list[torch.nn.Module] = []
        self._backward_sync_blocked = False
        self._forward_param_sync = True  # [Note: buffer broadcast]
        self._trainable_ids: set[int] | None = None  # the parameters the gradient engine was set up for
        self._policy: PrecisionPolicy | None = None

    @property
    def is_distributed(self) -> bool:
        """Always ``True``: makes Lightning inject a ``DistributedSampler`` and sync logged values."""
        return True

    @override
    def _configure_launcher(self) -> None:
        # Called while the Trainer is built, before any process starts: the last moment to reject a bad combination.
        self._check_before_launch()
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = SpawnLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self._init_process_group()

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _setup_replicas(self, trainer: pl.Trainer) -> None:
        """The start of every subclass's ``setup``: precision, device, and rank 0's weights on every rank."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._sync_states(self.model)
        self._apply_layer_sync(trainer)
        self._apply_activation_checkpointing(trainer)

    # ------------------------------------------------------------ precision
    @override
    def _lightning_precision(self) -> str:
        return getattr(self.precision_plugin, "precision", "32-true")

    def _setup_precision(self, trainer: pl.Trainer, cast_module: bool) -> None:
        self._setup_precision_of(self.precision_plugin, self.lightning_module, cast_module)

    def _teardown_precision(self) -> None:
        self._teardown_precision_of(self.precision_plugin, self.lightning_module)

    # ------------------------------------------------------------ buffers and layer sync
    @property
    def _fitting(self) -> bool:
        module = self.lightning_module
        return module is not None and module._trainer is not None and module.trainer.state.fn == TrainerFn.FITTING

    def _apply_activation_checkpointing(self, trainer: pl.Trainer) -> None:
        """During fits, the modules of ``activation_checkpointing_policy`` recompute their forward in backward."""
        module, policy = self.lightning_module, self.activation_checkpointing_policy
        if policy and module is not None and trainer.state.fn == TrainerFn.FITTING:
            self._checkpointed = activation_checkpointing.apply(module, policy)

    def _revert_activation_checkpointing(self) -> None:
        activation_checkpointing.revert(self._checkpointed)
        self._checkpointed = []

    def _apply_layer_sync(self, trainer: pl.Trainer) -> None:
        """``sync_batchnorm=True`` (fit only, as ``ddp``): Lightning's plugin is swapped for ours, which runs on
        CPU and through our collectives; another ``LayerSync`` plugin is applied as given. Converted layers stay as
        they are (a ZeRO-3 model kept sharded from an earlier fit keeps its hooks)."""
        self._forward_param_sync = True  # a fresh DDP wrapper starts with the flag set
        if isinstance(self._layer_sync, TorchSyncBatchNorm):
            self._layer_sync = ScratchSyncBatchNorm()
        if self._layer_sync is not None and trainer.state.fn == TrainerFn.FITTING:
            self.model = self._layer_sync.apply(self.model)

    def _revert_layer_sync(self) -> None:
        """After a fit: the module's own layers and forwards back (``sync_batchnorm``, activation checkpointing)."""
        self._revert_activation_checkpointing()
        module = self.lightning_module
        if isinstance(self._layer_sync, LayerSync) and module is not None and self._fitting:
            self.model = self._layer_sync.revert(module)

    @contextmanager
    def _buffer_sync(self) -> Generator[None, None, None]:
        """Around one step's forward: torch DDP's buffer rule ([Note: buffer broadcast]); a fit only."""
        module = self.lightning_module
        if not self._fitting or module is None:
            yield
            return
        if self.broadcast_buffers and self._forward_param_sync and comm.is_initialized():
            self._sync_buffers(module)
        yield
        self._forward_param_sync = torch.is_grad_enabled() and not self._backward_sync_blocked

    @contextmanager
    def _around_step(self) -> Generator[None, None, None]:
        """Around a training, validation, test or predict step: the buffer rule, then :meth:`_before_step`."""
        with self._buffer_sync():
            self._before_step()
            yield

    def _before_step(self) -> None:
        """Before a step calls into the module (subclasses: gather what a step may use outside any forward)."""

    def _sync_states(self, module: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers on every rank (at setup, as torch DDP's constructor does)."""
        broadcast_module_states(module)

    def _sync_buffers(self, module: torch.nn.Module) -> None:
        """Rank 0's buffers on every rank (subclasses whose ranks hold different parts of the model override it)."""
        broadcast_module_states(module, tag="buffers", buffers_only=True)

    def _at(self, stage: str) -> None:
        """Tell the watchdog where training is, for its messages ([Note: collective watchdog])."""
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        if trainer is not None:
            watchdog.at(f"{stage} step {trainer.global_step}, epoch {trainer.current_epoch}")

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._check_trainable()
        self._at("training")
        with self._around_step():
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._at("validation")
        with self._around_step():
            output = super().validation_step(*args, **kwargs)
        self._after_forward_only()
        return output

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._around_step():
            output = super().test_step(*args, **kwargs)
        self._after_forward_only()
        return output

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._around_step():
            output = super().predict_step(*args, **kwargs)
        self._after_forward_only()
        return output

    def _after_forward_only(self) -> None:
        """After a validation, test or predict step (subclasses: free what a forward without backward left
        gathered)."""

    # ------------------------------------------------------------ parameters unfrozen (or frozen) during a fit
    def _record_trainable(self) -> None:
        """At setup: the parameters the gradient engine was built for."""
        self._trainable_ids = trainable.trainable_ids(self.lightning_module)

    def _check_trainable(self) -> None:
        """Before each training step: has a callback (``BackboneFinetuning``) or the user changed ``requires_grad``?"""
        if names := trainable.changed(self.lightning_module, self._trainable_ids):
            self._trainable_changed(names)

    def _trainable_changed(self, names: list[str]) -> None:
        """React to parameters whose ``requires_grad`` changed since setup (``names``); by default refuse."""
        raise trainable.refusal(self.strategy_name, names)

    # ------------------------------------------------------------ gradient accumulation
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this on the non-boundary micro-batches of an accumulation window: what the gradient
        engine then does is :meth:`_engine_no_sync`'s business; the buffer rule notes it either way."""
        previous, self._backward_sync_blocked = self._backward_sync_blocked, True
        try:
            with self._engine_no_sync():
                yield None
        finally:
            self._backward_sync_blocked = previous

    def _engine_no_sync(self) -> AbstractContextManager:
        """What the gradient engine does on a non-boundary micro-batch (subclasses: skip communication)."""
        return nullcontext()

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        with self._engine_backward():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _engine_backward(self) -> AbstractContextManager:
        """What the gradient engine wraps each backward in (subclasses whose optimizers step stand-ins of the module's
        parameters: [Note: toggled-off optimizers] in ``lightning_zero/optim/sharding.py``)."""
        return nullcontext()

    # ------------------------------------------------------------ checkpoints
    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's, with a truncated or foreign file refused by name before any weight changes
        (:mod:`lightning_zero.training.checkpoint_checks`)."""
        with reading(checkpoint_path):
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if self.lightning_module is not None:
            check_shapes(checkpoint_path, shapes_of(checkpoint.get("state_dict", {})), self._full_model_shapes())
        return checkpoint

    def _full_model_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of each entry of the module's state dict as a whole-model checkpoint holds it (subclasses that
        split tensors give the unsplit shapes)."""
        return shapes_of(self.lightning_module.state_dict())

    @property
    def layout(self) -> dict[str, Any] | None:
        """How the model is split over the ranks, written into Lightning checkpoints as ``"parallel_layout"``
        (``None``: every rank holds the whole model, nothing is written)."""
        return None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        layout = self.layout
        checkpoint = {**checkpoint, "parallel_layout": layout} if layout is not None else checkpoint
        super().save_checkpoint(checkpoint, filepath, storage_options)

    # ------------------------------------------------------------ faults
    @override
    def on_exception(self, exception: BaseException) -> None:
        """A fit that fails because a peer died says which rank (:mod:`lightning_zero.training.faults`)."""
        faults.explain(exception, self.global_rank, self.world_size)

    # ------------------------------------------------------------ Lightning's collectives
    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce ``tensor`` in place across processes (``"mean"`` by default); non-tensors pass through."""
        return self.all_reduce(tensor, group, reduce_op)

    # ------------------------------------------------------------ memory
    @property
    def strategy_buffers(self) -> list[Tensor]:
        """Persistent tensors this strategy owns beyond parameters, gradients and optimizer state (none here)."""
        return []

    def model_state_params(self) -> list[Tensor]:
        """The parameters holding this rank's model state: the LightningModule's (subclasses add their shards)."""
        module = self.lightning_module
        return list(module.parameters()) if module is not None else []

    def model_state_bytes(self) -> ModelStateBytes:
        """This rank's model-state bytes now (:func:`lightning_zero.training.memory.model_state_bytes`): parameters,
        their gradients, the optimizers' state and :attr:`strategy_buffers`, each storage counted once."""
        return model_state_bytes(self.model_state_params(), self.optimizers, self.strategy_buffers)
