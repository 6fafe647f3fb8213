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

One optimizer per model. ``fabric.save``/``fabric.load`` are not supported yet under ZeRO and say so.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.fabric.base import ScratchFabricStrategy
from lightning_zero.training.distributed import ZERO_NAMES
from lightning_zero.zero.settings import ZeroSettings, build_stage3, build_stage12
from lightning_zero.zero.stage3.engine import ShardedParams
from lightning_zero.zero.stage12 import ShardedOptimizer


class ZeroStrategy(ScratchFabricStrategy):
    """Fabric's ZeRO stages 1, 2 and 3.

    Args:
        stage: 1, 2 or 3.
        **kwargs: ``grad_sync``, ``bucket_size_mb``, ``state_dict_type``, ``auto_wrap_policy``, ``min_num_params``,
            ``reshard_after_forward``, ``model_init``, ``grad_accum_dtype`` as for the Trainer's
            :class:`~lightning_zero.strategies.zero.ZeroStrategy`, and those of
            :class:`~lightning_zero.fabric.base.ScratchFabricStrategy`.
    """

    shards_parameters = True
    registered_names = ZERO_NAMES

    def __init__(self, stage: int = 2, **kwargs: Any) -> None:
        zero = {name: kwargs.pop(name) for name in ZeroSettings.__dataclass_fields__ if name in kwargs}
        settings = ZeroSettings.check(stage=stage, **zero)
        super().__init__(**kwargs)
        self.settings = settings
        settings.apply_to(self)
        self.strategy_name = f"zero{stage}_scratch"
        self.engine: ShardedOptimizer | ShardedParams | None = None

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        if len(optimizers) != 1:
            raise ValueError(f"{self.strategy_name} shards one optimizer per model: got {len(optimizers)}")
        return super().setup_module_and_optimizers(module, optimizers, scheduler)

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
            )
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self._module is None:
            raise RuntimeError("set up the module before its optimizer: fabric.setup_module(model) first")
        if isinstance(self.engine, ShardedParams):
            self.engine.attach_optimizer(optimizer)
        elif self.engine is not None:
            raise ValueError(f"{self.strategy_name} shards one optimizer per model: a second one was set up")
        else:
            self.engine = build_stage12(
                self.settings,
                self.precision_policy,
                self._module,
                optimizer,
                find_unused_parameters=self.find_unused_parameters,
            )
        return optimizer

    @override
    def _engine_no_sync(self) -> AbstractContextManager:
        """Non-boundary micro-batches: no communication with ``grad_sync="boundary"``; reduce anyway otherwise."""
        return self.settings.no_sync(self.engine)

    @override
    def _before_step(self, optimizer: Optimizer) -> None:
        if self.engine is not None:
            self.engine.before_step()

    @override
    def _after_step(self, optimizer: Optimizer) -> None:
        if self.engine is not None:
            self.engine.after_step()

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
        norm = self.engine.clip_grad_norm_(float(max_norm))
        if error_if_nonfinite and not math.isfinite(float(norm)):
            raise RuntimeError(
                f"The total norm of gradients is non-finite ({float(norm)}), so it cannot be clipped: pass"
                " error_if_nonfinite=False to skip"
            )
        return norm

    @override
    def save_checkpoint(self, path: Any, state: Any, storage_options: Any = None, filter: Any = None) -> None:
        raise NotImplementedError(f"fabric.save is not supported by {self.strategy_name} yet")

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, weights_only: Any = None) -> Any:
        raise NotImplementedError(f"fabric.load is not supported by {self.strategy_name} yet")

    @override
    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.remove()
        super().teardown()
