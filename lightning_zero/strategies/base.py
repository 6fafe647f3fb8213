"""The base of every lightning_zero strategy: processes, ranks, the process group and Lightning's collectives.

What a subclass inherits:

- **Launching** like Lightning's ``ddp``: ``start_method="popen"`` re-runs the script once per extra local rank,
  ``"spawn"``/``"fork"``/``"forkserver"`` start workers with :mod:`torch.multiprocessing`. When the processes are
  created outside (``torchrun``, SLURM), Lightning's cluster environment says so and nothing is launched.
- **The process group** from that cluster environment, backend ``gloo`` on CPU and ``nccl`` on CUDA unless
  ``process_group_backend`` says otherwise.
- ``is_distributed = True``, so Lightning injects a ``DistributedSampler`` into every loader.
- ``reduce``/``all_gather``/``broadcast``/``barrier`` through :mod:`lightning_zero.comm.collectives`, which is what
  ``self.log(..., sync_dist=True)`` and ``trainer.strategy.reduce`` use.
- **Mixed precision as a property of the engine** ([Note: precision policy] in
  ``lightning_zero/training/precision.py``): ``param_dtype``/``reduce_dtype``/``master_weights``/``cast_module``,
  defaulted from the Trainer's ``precision``, and a loss scaler (``16-mixed``) whose inf/NaN check covers every rank.
- **Buffers as torch DDP keeps them** ([Note: buffer broadcast] below) and ``sync_batchnorm=True`` through
  :mod:`lightning_zero.training.sync_batchnorm`.
- **The process group torn down at exit**: a script that ends with the group alive was measured to abort now and
  then at interpreter exit ("terminate called without an active exception", SIGABRT) after a successful fit, with
  Lightning's ``ddp`` as well; an ``atexit`` handler destroys whatever group is still alive first.

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

import atexit
import logging
from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_zero.comm import collectives as comm
from lightning_zero.training import activation_checkpointing
from lightning_zero.training.memory import ModelStateBytes, model_state_bytes
from lightning_zero.training.precision import (
    DEFAULT,
    PrecisionPolicy,
    ShardedGradScaler,
    cast_buffers,
    cast_floats,
    parse_dtype,
    resolve_policy,
    restore_buffers,
    unified_precision,
)
from lightning_zero.training.sync_batchnorm import ScratchSyncBatchNorm

log = logging.getLogger(__name__)

START_METHODS = ("popen", "spawn", "fork", "forkserver")
BACKENDS = ("gloo", "nccl", "mpi", "ucc")


def broadcast_module_states(module: Any, src: int = 0, tag: str = "sync_states", buffers_only: bool = False) -> None:
    """Make every rank's parameters and buffers equal to rank ``src``'s (tied tensors are sent once)."""
    tensors = [] if buffers_only else list(module.parameters())
    tensors += list(module.buffers())
    for tensor in tensors:
        comm.broadcast(tensor.data, src, tag=tag)


def check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is invalid: expected True or False")


_exit_handler_registered = False


def _destroy_process_group_at_exit() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def destroy_process_group_at_exit() -> None:
    """Register (once per process) the ``atexit`` handler that destroys a process group still alive at exit."""
    global _exit_handler_registered
    if not _exit_handler_registered:
        atexit.register(_destroy_process_group_at_exit)
        _exit_handler_registered = True


def _reduce_op_name(reduce_op: Any) -> str:
    """Lightning passes ``"mean"``/``"sum"``/... strings or ``torch.distributed.ReduceOp`` members."""
    if reduce_op is None:
        return "sum"
    if isinstance(reduce_op, str):
        return "avg" if reduce_op.lower() == "mean" else reduce_op.lower()
    for name in ("sum", "avg", "max", "min", "product"):
        if reduce_op == getattr(dist.ReduceOp, name.upper()):
            return name
    raise ValueError(f"reduce_op={reduce_op!r} is invalid: expected 'mean', 'sum', 'max', 'min' or a ReduceOp")


class SpawnLauncher(_MultiProcessingLauncher):
    """Lightning's spawn launcher, with each worker's process group destroyed before the worker exits.

    A worker that exits with its gloo process group alive was measured to abort now and then ("terminate called
    without an active exception", SIGABRT) while the interpreter shuts down, failing a ``trainer.validate`` that
    itself succeeded; it happened in sweeps of spawn jobs under load.
    """

    @override
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        try:
            super()._wrapping_function(*args, **kwargs)
        finally:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()


class ScratchParallelStrategy(ParallelStrategy):
    """Multi-process, one-device-per-process strategy base: launching, process group and collectives.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as in Lightning's
            ``DDPStrategy``; the Trainer fills them in.
        process_group_backend: ``"gloo"``, ``"nccl"``, ``"mpi"`` or ``"ucc"``; default ``gloo`` on CPU and ``nccl``
            on CUDA.
        timeout: collective timeout (a ``timedelta`` or seconds). A rank that dies makes the others fail after at
            most this long instead of hanging.
        start_method: ``"popen"`` (default), ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        find_unused_parameters: allow trainable parameters that get no gradient in a backward pass, as torch DDP's
            option of that name: they are averaged as zeros where a rank did not use them, and a parameter no rank
            used in an optimizer step is left untouched by that step (its gradient stays ``None``). Off (default): such
            a parameter raises an error naming it.
        broadcast_buffers: re-broadcast rank 0's buffers as torch DDP does ([Note: buffer broadcast]).
        param_dtype, reduce_dtype: ``"bf16"``, ``"fp16"``, ``"fp32"``, a torch dtype, ``None`` (the module's own
            dtype) or ``"auto"`` (default: from the Trainer's ``precision``); see [Note: precision policy] in
            ``lightning_zero/training/precision.py``.
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
    shards_parameters = False  # ZeRO: param_dtype defaults to the low-precision dtype under "-mixed"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        start_method: str = "popen",
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        param_dtype: str | torch.dtype | None = DEFAULT,
        reduce_dtype: str | torch.dtype | None = DEFAULT,
        master_weights: bool = True,
        cast_module: bool = False,
        activation_checkpointing_policy: set[type] | None = None,
    ) -> None:
        check_flag("find_unused_parameters", find_unused_parameters)
        check_flag("broadcast_buffers", broadcast_buffers)
        check_flag("master_weights", master_weights)
        check_flag("cast_module", cast_module)
        self.activation_checkpointing_policy = activation_checkpointing.check_policy(activation_checkpointing_policy)
        self._checkpointed: list[torch.nn.Module] = []
        self._precision_settings = {
            "param_dtype": parse_dtype("param_dtype", param_dtype),
            "reduce_dtype": parse_dtype("reduce_dtype", reduce_dtype),
            "master_weights": master_weights,
            "cast_module": cast_module,
        }
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if process_group_backend is not None and process_group_backend not in BACKENDS:
            raise ValueError(
                f"process_group_backend={process_group_backend!r} is invalid: expected one of {BACKENDS} or None"
                " (gloo on CPU, nccl on CUDA)"
            )
        if start_method not in START_METHODS:
            raise ValueError(f"start_method={start_method!r} is invalid: expected one of {START_METHODS}")
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
            timeout = timedelta(seconds=timeout)
        if timeout is not None and (not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0):
            raise ValueError(f"timeout={timeout!r} is invalid: expected a positive timedelta or number of seconds")
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self._num_nodes = 1
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self._backward_sync_blocked = False
        self._forward_param_sync = True  # [Note: buffer broadcast]
        self._trainable_ids: set[int] | None = None  # the parameters the gradient engine was set up for
        self._policy: PrecisionPolicy | None = None
        self._cast_buffers: dict[str, torch.dtype] = {}  # buffers cast by the policy, with their own dtypes

    # ------------------------------------------------------------ topology
    @property
    def is_distributed(self) -> bool:
        """Always ``True``: makes Lightning inject a ``DistributedSampler`` and sync logged values."""
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------ launch + process group
    def _resolved_backend(self) -> str:
        if self._process_group_backend is not None:
            return self._process_group_backend
        return "nccl" if self.root_device.type == "cuda" else "gloo"

    @override
    def _configure_launcher(self) -> None:
        # Called while the Trainer is built, before any process starts: the last moment to reject a bad combination.
        if self.parallel_devices and self._process_group_backend == "nccl" and self.root_device.type != "cuda":
            raise ValueError(
                f"process_group_backend='nccl' needs CUDA devices, but this run uses {self.root_device.type!r}:"
                " use 'gloo' (or leave it unset) on CPU"
            )
        self._policy = None  # the Trainer may have set another precision plugin: a bad setting fails here
        self.precision_policy  # noqa: B018
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = SpawnLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._resolved_backend()
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type == "cuda" else None
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id
        )
        destroy_process_group_at_exit()

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
        broadcast_module_states(self.model)
        self._apply_layer_sync(trainer)
        self._apply_activation_checkpointing(trainer)

    # ------------------------------------------------------------ precision
    @property
    def precision_policy(self) -> PrecisionPolicy:
        """The dtypes of this run, from the strategy's settings and the Trainer's ``precision``."""
        if self._policy is None:
            precision = unified_precision(getattr(self.precision_plugin, "precision", "32-true"))
            self._policy = resolve_policy(precision, **self._precision_settings, sharded=self.shards_parameters)
        return self._policy

    def _setup_precision(self, trainer: pl.Trainer, cast_module: bool) -> None:
        """At setup: the loss scaler made shard-aware; with ``cast_module`` (the engine casts the parameters) the
        float buffers and the float inputs of every step cast too."""
        plugin, policy = self.precision_plugin, self.precision_policy
        rounds = isinstance(plugin, MixedPrecision) and policy.param_dtype is not None and not policy.casts_module
        if rounds and self._precision_settings["param_dtype"] == DEFAULT:
            rank_zero_warn(
                f"{self.strategy_name} with precision={plugin.precision!r} communicates the parameters in"
                f" param_dtype={policy.param_dtype} and the module computes with their rounded values, so the weights"
                " differ from Lightning's ddp by that rounding (fp32 master weights are updated). Pass"
                " param_dtype=None for ddp's arithmetic, or param_dtype='bf16'/'fp16' to silence this.",
                category=PossibleUserWarning,
            )
        scaler = plugin.scaler if isinstance(plugin, MixedPrecision) else None
        if scaler is not None and not isinstance(scaler, ShardedGradScaler):
            plugin.scaler = ShardedGradScaler.like(scaler)
        if cast_module and policy.casts_module and self.lightning_module is not None:
            self._cast_buffers.update(cast_buffers(self.lightning_module, policy.cast_dtype))
            plugin.convert_input = partial(cast_floats, dtype=policy.cast_dtype)  # type: ignore[method-assign]

    def _teardown_precision(self) -> None:
        """Undo :meth:`_setup_precision`'s casts (the buffers get their own dtype back)."""
        self.precision_plugin.__dict__.pop("convert_input", None)
        if self._cast_buffers and self.lightning_module is not None:
            restore_buffers(self.lightning_module, self._cast_buffers)
        self._cast_buffers = {}

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
            broadcast_module_states(module, tag="buffers", buffers_only=True)
        yield
        self._forward_param_sync = torch.is_grad_enabled() and not self._backward_sync_blocked

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._check_trainable()
        with self._buffer_sync():
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._buffer_sync():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._buffer_sync():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._buffer_sync():
            return super().predict_step(*args, **kwargs)

    # ------------------------------------------------------------ parameters unfrozen (or frozen) during a fit
    def _record_trainable(self) -> None:
        """At setup: the parameters the gradient engine was built for."""
        module = self.lightning_module
        self._trainable_ids = {id(p) for p in module.parameters() if p.requires_grad} if module is not None else set()

    def _check_trainable(self) -> None:
        """Before each training step: has a callback (``BackboneFinetuning``) or the user changed ``requires_grad``?"""
        module, recorded = self.lightning_module, self._trainable_ids
        if module is None or recorded is None:
            return
        changed = [n for n, p in module.named_parameters() if p.requires_grad != (id(p) in recorded)]
        if changed:
            self._trainable_changed(changed)

    def _trainable_changed(self, names: list[str]) -> None:
        """React to parameters whose ``requires_grad`` changed since setup (``names``); by default refuse."""
        raise RuntimeError(
            f"{self.strategy_name}: the parameters {names} changed requires_grad after the fit started (e.g."
            " BackboneFinetuning unfreezing a backbone), but this strategy shards or aggregates the gradients and"
            " optimizer state of the parameters that were trainable at setup only. Declare them trainable from the"
            " start (requires_grad=True, in their own optimizer param group with lr=0 until they should train), or"
            " use ddp_scratch, which follows such changes."
        )

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

    # ------------------------------------------------------------ Lightning's collectives
    def _device_ids(self) -> list[int] | None:
        return None if self.root_device.type == "cpu" else [self.root_device.index]

    @override
    def barrier(self, name: str | None = None) -> None:
        if comm.is_initialized():
            comm.barrier(device_ids=self._device_ids(), tag=name or "barrier")

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not comm.is_initialized():
            return obj
        return comm.broadcast_object(obj, src, tag="strategy")

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce ``tensor`` in place across processes (``"mean"`` by default); non-tensors pass through."""
        if not isinstance(tensor, Tensor) or not comm.is_initialized():
            return tensor
        op = _reduce_op_name(reduce_op)
        if op == "avg" and not tensor.is_floating_point():
            comm.all_reduce(tensor, "sum", group=group, tag="reduce")
            return tensor.copy_(tensor / comm.world_size(group))
        comm.all_reduce(tensor, op, group=group, tag="reduce")
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        """Stack ``tensor`` from every process into ``(world_size, *shape)``."""
        if not comm.is_initialized():
            return tensor
        return comm.all_gather_stack(tensor, group=group, sync_grads=sync_grads, tag="strategy")

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

    # ------------------------------------------------------------ registration
    @classmethod
    def _register(cls, registry: _StrategyRegistry, name: str, description: str, **init_params: Any) -> None:
        """Register ``name``; re-importing lightning_zero (or reloading it) replaces our own entry, never another's."""
        if name in registry:
            owner = registry[name]["strategy"]
            if not owner.__module__.startswith("lightning_zero"):
                raise ValueError(f"strategy name {name!r} is already registered by {owner.__module__}.{owner.__name__}")
        registry.register(name, cls, description=description, override=True, **init_params)
