"""The base of every lightning_zero Fabric strategy: ``fabric.launch()``, ranks, the process group, collectives and
the precision policy, on the plumbing the Trainer strategies use (``lightning_zero/training/distributed.py``).

A subclass builds its gradient engine in ``setup_module_and_optimizers`` and drives it from :meth:`optimizer_step`
and the clipping hooks: :meth:`ScratchFabricStrategy._before_step` runs once per optimizer step, before the first of
``fabric.clip_gradients`` / ``optimizer.step()``, so unscaling and clipping see the gradients the optimizer will use.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.fabric.checkpoint import Roles, check_keys, from_fabric_layout, restore_others, to_layout
from lightning_zero.training import activation_checkpointing
from lightning_zero.training.distributed import DistributedPlumbing, broadcast_module_states
from lightning_zero.zero.checkpointing import MODEL, OPTIMIZERS
from lightning_zero.zero.stage3.materialize import has_meta_tensors


class _EngineNoSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model, enabled)``: what the strategy's engine does on a non-boundary micro-batch."""

    def __init__(self, strategy: ScratchFabricStrategy) -> None:
        self.strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return self.strategy._no_backward_sync() if enabled else nullcontext()


class ScratchFabricStrategy(DistributedPlumbing, ParallelStrategy):
    """Multi-process, one-device-per-process Fabric strategy base.

    ``accelerator``, ``parallel_devices``, ``cluster_environment``, ``checkpoint_io`` and ``precision`` are those of
    Fabric's ``DDPStrategy``; Fabric fills them in.

    Args:
        **settings: ``process_group_backend``, ``timeout``, ``collective_timeout``, ``start_method``,
            ``find_unused_parameters``, ``broadcast_buffers`` (rank 0's buffers broadcast before a forward whose
            previous forward ran with gradients enabled outside ``no_backward_sync``, as torch DDP does),
            ``param_dtype``, ``reduce_dtype``, ``master_weights``, ``cast_module``,
            ``activation_checkpointing_policy``: as for the Trainer strategies
            (:class:`~lightning_zero.strategies.base.ScratchParallelStrategy`).
    """

    engine: Any = None  # the subclass's gradient engine over the module set up (it has .remove())

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        **settings: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self._init_settings(**settings)
        self._backward_sync_control = _EngineNoSync(self)
        self._module: nn.Module | None = None  # the module set up, for the precision casts and buffer broadcast
        self._checkpointed: list[nn.Module] = []  # modules whose forward activation checkpointing replaced
        self._prepared = False  # _before_step ran for the current optimizer step
        self._forward_param_sync = True  # torch DDP's require_forward_param_sync
        self._backward_sync_blocked = False  # inside fabric.no_backward_sync(..., enabled=True)

    @override
    def _lightning_precision(self) -> str:
        return getattr(self.precision, "precision", "32-true")

    # ------------------------------------------------------------ launch + process group
    @override
    def _configure_launcher(self) -> None:
        self._check_before_launch()
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._init_process_group()

    @override
    def module_to_device(self, module: nn.Module) -> None:
        module.to(self.root_device)

    # ------------------------------------------------------------ module, buffers, precision
    def _setup_replica(self, module: nn.Module) -> None:
        """Rank 0's weights on every rank, torch DDP's buffer rule, the precision policy's casts and scaler, and
        activation checkpointing (before any engine hooks the module). A second ``fabric.setup`` (a fresh model
        to load a checkpoint into) replaces the first model's engine, and the first model refuses to run again."""
        self._remove_engine()
        if not has_meta_tensors(module):  # a meta-device model is built by the stage-3 engine, alike on every rank
            self._sync_states(module)
        self._module = module
        if self.activation_checkpointing_policy:
            self._checkpointed = activation_checkpointing.apply(module, self.activation_checkpointing_policy)
        module.register_forward_pre_hook(self._check_current)
        module.register_forward_pre_hook(self._broadcast_buffers)
        module.register_forward_hook(self._after_forward)
        self._setup_precision_of(self.precision, module, cast_module=True)

    def _check_current(self, module: nn.Module, args: Any) -> None:
        """A model set up before the last ``fabric.setup`` has no engine any more: its gradients would go unaveraged
        (two models set up one after the other, as a GAN's generator and discriminator often are)."""
        if module is not self._module:
            raise RuntimeError(
                f"{self.strategy_name} trains one model at a time: {type(module).__name__} was set up before"
                f" {type(self._module).__name__}, whose setup replaced its engine, so its gradients would not be"
                " averaged. Put the models into one module (a GAN's generator and discriminator as attributes of one"
                " nn.Module, called through its forward) and set it up with all their optimizers:"
                " fabric.setup(model, g_opt, d_opt)"
            )

    def _broadcast_buffers(self, module: nn.Module, args: Any) -> None:
        if self.broadcast_buffers and self._forward_param_sync:
            self._sync_buffers(module)

    def _sync_states(self, module: nn.Module) -> None:
        """Rank 0's parameters and buffers on every rank (at setup, as torch DDP's constructor does)."""
        broadcast_module_states(module)

    def _sync_buffers(self, module: nn.Module) -> None:
        """Rank 0's buffers on every rank (torch DDP's buffer rule, before a forward)."""
        broadcast_module_states(module, tag="buffers", buffers_only=True)

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._forward_param_sync = torch.is_grad_enabled() and not self._backward_sync_blocked

    @contextmanager
    def _no_backward_sync(self) -> Generator[None, None, None]:
        self._backward_sync_blocked = True
        try:
            with self._engine_no_sync():
                yield
        finally:
            self._backward_sync_blocked = False

    def _engine_no_sync(self) -> AbstractContextManager:
        """What the engine does on a non-boundary micro-batch (subclasses: skip communication)."""
        return nullcontext()

    # ------------------------------------------------------------ the optimizer step
    def _before_step(self, optimizer: Optimizer) -> None:
        """Once per optimizer step, after the last backward: the engine's gradients ready for the optimizer."""

    def _after_step(self, optimizer: Optimizer) -> None:
        """After the optimizer's update (or its skip by the loss scaler)."""

    def _prepare(self, optimizer: Optimizer) -> None:
        if not self._prepared:
            self._before_step(optimizer)
            self._prepared = True

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self._prepare(optimizer)
        output = super().optimizer_step(optimizer, **kwargs)
        self._after_step(optimizer)  # collective (ZeRO-1/2 gather the shards): not after an error
        self._prepared = False
        return output

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        self._prepare(optimizer)
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self._prepare(optimizer)
        return super().clip_gradients_value(module, optimizer, clip_val)

    # ------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any | None = None, filter: Any | None = None
    ) -> None:
        """``state`` in the layout the Trainer strategies write ([Note: checkpoint layout] in
        ``lightning_zero/zero/checkpointing.py``, :mod:`lightning_zero.fabric.checkpoint`). Collective."""
        roles = Roles.of(state, self._module)
        checkpoint = to_layout(self._convert_stateful_objects_in_state(state, filter or {}), roles)
        checkpoint.update(self._strategy_state())
        optimizers = [state[key] for key in roles.optimizers]
        self._write_checkpoint(path, checkpoint, storage_options, filtered=bool(filter), optimizers=optimizers)

    @override
    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """A checkpoint of either front end, or a file in Fabric's own layout, into the objects of ``state`` (a dict,
        or a module or optimizer for ``fabric.load_raw``); returns what is left of it. Collective."""
        if isinstance(state, (nn.Module, Optimizer)):
            raw = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
            if isinstance(state, nn.Module):
                self.load_module_state_dict(state, raw, strict=strict)
            else:
                self._load_optimizer_state(state, raw)
            return {}
        if not state:
            return self._read_whole(path, weights_only)
        roles = Roles.of(state, self._module)

        def read_full(file: Any) -> dict[str, Any]:
            checkpoint = from_fabric_layout(self.checkpoint_io.load_checkpoint(file, weights_only=weights_only), roles)
            if strict:  # before any weight changes
                check_keys(state, checkpoint, roles, file)
            return checkpoint

        optimizers = [state[key] for key in roles.optimizers]
        checkpoint, model_loaded, optimizers_loaded = self._read_checkpoint(path, read_full, optimizers)
        if strict:
            check_keys(state, checkpoint, roles, path)
        if roles.model is not None and not model_loaded and MODEL in checkpoint:
            self.load_module_state_dict(state[roles.model], checkpoint[MODEL], strict=strict)
        if not optimizers_loaded:
            for key, optimizer_state in zip(roles.optimizers, checkpoint.get(OPTIMIZERS, [])):
                self._load_optimizer_state(state[key], optimizer_state)
        self._load_strategy_state(checkpoint)
        return restore_others(state, checkpoint, roles)

    def _write_checkpoint(
        self, path: Any, checkpoint: dict[str, Any], storage_options: Any, filtered: bool, optimizers: list[Optimizer]
    ) -> None:
        """Write a checkpoint in the shared layout: one file, from rank 0. ``optimizers``: the state's optimizers, in
        the order of the checkpoint's ``"optimizer_states"``."""
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def _read_checkpoint(
        self, path: Any, read_full: Callable[[Any], dict[str, Any]], optimizers: list[Optimizer]
    ) -> tuple[dict[str, Any], bool, bool]:
        """The checkpoint at ``path`` in the shared layout, and whether reading it loaded the model and the
        optimizers (the state's, in the order of ``"optimizer_states"``) already (a sharded engine reads straight
        into its shards)."""
        return read_full(path), False, False

    def _read_whole(self, path: Any, weights_only: bool | None) -> dict[str, Any]:
        """``fabric.load(path)`` without a state: the file as it is."""
        return self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)

    def _load_optimizer_state(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        """One optimizer's state, in the format of ``optimizer.state_dict()``."""
        optimizer.load_state_dict(state)

    def _strategy_state(self) -> dict[str, Any]:
        """The strategy's own checkpoint entries (collective)."""
        return {}

    def _load_strategy_state(self, checkpoint: dict[str, Any]) -> None:
        """Restore :meth:`_strategy_state`'s entries, popping them from ``checkpoint``."""

    def _remove_engine(self) -> None:
        """The end of a run, or a second ``fabric.setup``: the engine's hooks removed and the engine dropped."""
        if self.engine is not None:
            self.engine.remove()
            self.engine = None

    @override
    def teardown(self) -> None:
        self._remove_engine()
        self._teardown_precision_of(self.precision, self._module)
        activation_checkpointing.revert(self._checkpointed)
        self._checkpointed = []
        super().teardown()
