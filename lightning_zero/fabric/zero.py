"""``zero1_scratch``, ``zero2_scratch``, ``zero3_scratch`` under Fabric, on the Trainer's ZeRO engines
(:mod:`lightning_zero.zero.stage12`, :mod:`lightning_zero.zero.stage3.engine`), built from the same settings
(:mod:`lightning_zero.zero.settings`).

Runbook::

    import lightning_zero  # registers the names with Fabric too
    fabric = Fabric(accelerator="cpu", devices=2, strategy="zero2_scratch")
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)  # the optimizer is rebuilt in place over this rank's shards
    with fabric.no_backward_sync(model, enabled=not boundary):  # grad_sync="boundary": nothing communicated
        fabric.backward(loss)
    fabric.clip_gradients(model, optimizer, max_norm=1.0)      # the global norm over every rank's shard
    optimizer.step()                                           # then the updated shards are all-gathered

Several optimizers (a GAN's generator and discriminator) are each sharded on their own when set up together,
``fabric.setup(model, g_opt, d_opt)``; each parameter belongs to one of them. ``fabric.save`` writes a sharded
directory by default (``state_dict_type="full"``: one file from rank 0) in the layout of the Trainer's ZeRO strategy,
so either front end loads the other's checkpoints ([Note: checkpoint layout] in
``lightning_zero/zero/checkpointing.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.comm.powersgd_config import refuse_on_zero
from lightning_zero.fabric.base import ScratchFabricStrategy
from lightning_zero.training.distributed import ZERO_NAMES
from lightning_zero.training.precision import DEFAULT
from lightning_zero.zero.checkpoint import is_sharded_checkpoint
from lightning_zero.zero.checkpointing import ZeroCheckpointer
from lightning_zero.zero.settings import ZeroSettings, build_stage3, build_stage12
from lightning_zero.zero.stage3.engine import ShardedParams
from lightning_zero.zero.stage3.materialize import has_meta_tensors, rng_state
from lightning_zero.zero.stage12 import ShardedOptimizer


class ZeroStrategy(ScratchFabricStrategy):
    """Fabric's ZeRO stages 1, 2 and 3.

    Args:
        stage: 1, 2 or 3.
        **kwargs: ``grad_sync``, ``bucket_size_mb``, ``state_dict_type``, ``auto_wrap_policy``, ``min_num_params``,
            ``reshard_after_forward``, ``model_init``, ``grad_accum_dtype``, ``quantized_weights``,
            ``quantized_grads``, ``quant_block_size``, ``shard_size``, ``grad_reduction`` as for the Trainer's
            :class:`~lightning_zero.strategies.zero.ZeroStrategy`, and those of
            :class:`~lightning_zero.fabric.base.ScratchFabricStrategy`. ``grad_compression`` is refused
            (``ddp_scratch`` only; ``None`` passes).
    """

    shards_parameters = True
    registered_names = ZERO_NAMES

    def __init__(self, stage: int = 2, **kwargs: Any) -> None:
        refuse_on_zero(f"zero{stage}_scratch", kwargs)
        zero = {name: kwargs.pop(name) for name in ZeroSettings.__dataclass_fields__ if name in kwargs}
        settings = ZeroSettings.check(stage=stage, reduce_dtype=kwargs.get("reduce_dtype", DEFAULT), **zero)
        super().__init__(**kwargs)
        self.settings = settings
        settings.apply_to(self)
        self.strategy_name = f"zero{stage}_scratch"
        self.engine: ShardedOptimizer | ShardedParams | None = None
        self._init_rng_state: dict[str, torch.Tensor] | None = None  # fabric.init_module(empty_init=True), stage 3

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        """``fabric.setup(model, *optimizers)``: each optimizer sharded on its own (a GAN's two), each parameter in
        one of them."""
        module = self.setup_module(module)
        self._attach(optimizers)
        return module, optimizers, scheduler

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=True)`` under stage 3: the model is built on the meta device, and
        ``fabric.setup`` materialises it unit by unit, replaying each module's ``reset_parameters()`` from the random
        state of this moment, so no rank ever holds all of it and the weights are those of a normal build when every
        initialisation goes through ``reset_parameters()`` ([Note: meta initialisation] in
        ``lightning_zero/zero/stage3/materialize.py``)."""
        if self.stage != 3 or not empty_init:
            return super().module_init_context(empty_init)
        self._init_rng_state = rng_state(self.root_device)
        stack = ExitStack()
        stack.enter_context(self.precision.module_init_context())
        stack.enter_context(torch.device("meta"))
        return stack

    @override
    def module_to_device(self, module: nn.Module) -> None:
        if not has_meta_tensors(module):  # a meta-device model is built on the device by the stage-3 engine
            super().module_to_device(module)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        self._setup_replica(module)
        if self.stage == 3:
            self.engine = build_stage3(
                self.settings,
                self.precision_policy,
                module,
                device=self.root_device,
                timeout=self._timeout,
                find_unused_parameters=self.find_unused_parameters,
                rng_state=self._init_rng_state,
            )
            self._init_rng_state = None
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """``fabric.setup_optimizers(optimizer)`` after ``fabric.setup_module(model)``: one optimizer per call."""
        self._attach([optimizer])
        return optimizer

    def _attach(self, optimizers: list[Optimizer]) -> None:
        """Shard ``optimizers`` over the module set up: stages 1 and 2 flatten their param groups, stage 3 rebuilds
        them over its shards. All of a model's optimizers are sharded at once: a second call cannot add one."""
        if self._module is None:
            raise RuntimeError("set up the module before its optimizer: fabric.setup_module(model) first")
        if self.engine is not None and (not isinstance(self.engine, ShardedParams) or self.engine.optimizers):
            raise ValueError(
                f"{self.strategy_name} shards all of a model's optimizers at once, and one was set up already: pass"
                " them together, fabric.setup(model, optimizer_1, optimizer_2)"
            )
        if isinstance(self.engine, ShardedParams):
            self.engine.attach_optimizers(optimizers)
        else:
            self.engine = build_stage12(
                self.settings,
                self.precision_policy,
                self._module,
                optimizers,
                find_unused_parameters=self.find_unused_parameters,
            )

    @override
    def _engine_no_sync(self) -> AbstractContextManager:
        """Non-boundary micro-batches: no communication with ``grad_sync="boundary"``; reduce anyway otherwise."""
        return self.settings.no_sync(self.engine)

    @override
    def _before_step(self, optimizer: Optimizer) -> None:
        if self.engine is not None:
            self.engine.before_step(optimizer)

    @override
    def _after_step(self, optimizer: Optimizer) -> None:
        if self.engine is not None:
            self.engine.after_step(optimizer)

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """The global gradient norm over every rank's shard (one scalar all-reduce), as ``ddp`` clips the whole
        gradient."""
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type={norm_type!r} is not supported by {self.strategy_name}: expected 2")
        assert self.engine is not None
        self._prepare(optimizer)
        self.precision.unscale_gradients(optimizer)
        norm = self.engine.clip_grad_norm_(float(max_norm), optimizer)
        if error_if_nonfinite and not math.isfinite(float(norm)):
            raise RuntimeError(
                f"The total norm of gradients is non-finite ({float(norm)}), so it cannot be clipped: pass"
                " error_if_nonfinite=False to skip"
            )
        return norm

    # ------------------------------------------------------------ checkpoints
    def _checkpointer(self, optimizers: list[Optimizer] | None = None) -> ZeroCheckpointer:
        """The checkpointer of the module set up; ``optimizers``: a state's, in the checkpoint's order (those the
        engine shards)."""
        if self._module is None:
            raise RuntimeError(f"{self.strategy_name} saves and loads the module it set up: fabric.setup(model) first")
        order = None if optimizers is None else [o for o in optimizers if self._is_engines(o)]
        return ZeroCheckpointer(self._module, self.engine, sharded=self.state_dict_type == "sharded", order=order)

    def _is_engines(self, optimizer: Optimizer) -> bool:
        return self.engine is not None and any(opt is optimizer for opt in self.engine.optimizers)

    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The module set up: stage 3's weights gathered (full, rank 0) or per-parameter DTensors (sharded)."""
        return self._checkpointer().model_state() if module is self._module else module.state_dict()

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The sharded optimizer: this rank's shards (sharded) or the unsharded format gathered on rank 0 (full)."""
        if not self._is_engines(optimizer):
            return optimizer.state_dict()
        checkpointer = self._checkpointer()
        return checkpointer.optimizer_state(checkpointer.index(optimizer))

    @override
    def _write_checkpoint(
        self, path: Any, checkpoint: dict[str, Any], storage_options: Any, filtered: bool, optimizers: list[Optimizer]
    ) -> None:
        checkpointer = self._checkpointer(optimizers)
        if filtered and checkpointer.sharded:
            raise ValueError(
                f"fabric.save(filter=...) writes full checkpoints only: {self.strategy_name} has"
                " state_dict_type='sharded'; pass state_dict_type='full' to filter"
            )
        write_full = super()._write_checkpoint
        checkpointer.save(checkpoint, path, lambda full: write_full(path, full, storage_options, filtered, optimizers))

    @override
    def _read_checkpoint(
        self, path: Any, read_full: Callable[[Any], dict[str, Any]], optimizers: list[Optimizer]
    ) -> tuple[dict[str, Any], bool, bool]:
        checkpointer = self._checkpointer(optimizers)
        checkpoint, model_loaded = checkpointer.load(path, read_full)
        return checkpoint, model_loaded, checkpointer.has_optimizer

    @override
    def _read_whole(self, path: Any, weights_only: bool | None) -> dict[str, Any]:
        if is_sharded_checkpoint(path):
            raise ValueError(
                f"{path} is a sharded checkpoint: it loads into objects, fabric.load(path, {{'model': model,"
                " 'optimizer': optimizer}) after fabric.setup"
            )
        return super()._read_whole(path, weights_only)

    @override
    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        if module is not self._module:
            return super().load_module_state_dict(module, state_dict, strict)
        self._checkpointer().load_model(state_dict, strict)

    @override
    def _load_optimizer_state(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        if not self._is_engines(optimizer):
            return super()._load_optimizer_state(optimizer, state)
        checkpointer = self._checkpointer()
        checkpointer.load_optimizer(state, checkpointer.index(optimizer))
        if isinstance(self.engine, ShardedOptimizer):
            self.engine.sync_after_load()  # fabric.load_raw: the parameters follow masters loaded with the state
