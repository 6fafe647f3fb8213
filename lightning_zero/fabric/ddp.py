"""``ddp_scratch`` under Fabric: the engine of the Trainer's ``ddp_scratch`` (:mod:`lightning_zero.dp.engine`).

Runbook::

    import lightning_zero  # registers the names with Fabric too
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp_scratch")
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    with fabric.no_backward_sync(model, enabled=not boundary):  # accumulates, communicates nothing
        fabric.backward(loss)

The module is not wrapped: gradients are averaged by autograd hooks while backward runs.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.dp.engine import DataParallelEngine
from lightning_zero.fabric.base import ScratchFabricStrategy
from lightning_zero.training.distributed import DDP_NAMES, check_bucket_size


class ScratchDDPStrategy(ScratchFabricStrategy):
    """Fabric's ``ddp_scratch``.

    Args:
        bucket_size_mb: cap of one gradient bucket in MiB (> 0).
        **kwargs: see :class:`~lightning_zero.fabric.base.ScratchFabricStrategy`.
    """

    strategy_name = "ddp_scratch"
    registered_names = DDP_NAMES

    def __init__(self, bucket_size_mb: float = 25, **kwargs: Any) -> None:
        check_bucket_size(bucket_size_mb)
        super().__init__(**kwargs)
        self.bucket_size_mb = bucket_size_mb
        self.engine: DataParallelEngine | None = None

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        self._setup_replica(module)
        self.engine = DataParallelEngine(
            module,
            self.precision_policy,
            bucket_cap_bytes=int(self.bucket_size_mb * 2**20),
            find_unused_parameters=self.find_unused_parameters,
        )
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self.engine is None:
            raise RuntimeError("set up the module before its optimizer: fabric.setup_module(model) first")
        self.engine.attach_optimizers([optimizer])
        return optimizer

    @override
    def _engine_no_sync(self) -> AbstractContextManager:
        reducer = self.engine.reducer if self.engine is not None else None
        return reducer.no_sync() if reducer is not None else nullcontext()

    @override
    def _before_step(self, optimizer: Optimizer) -> None:
        if self.engine is not None:
            self.engine.before_step(optimizer)

    @override
    def _after_step(self, optimizer: Optimizer) -> None:
        if self.engine is not None:
            self.engine.after_step(optimizer)

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state, with each parameter's fp32 ``"master"`` when master weights are kept."""
        state = optimizer.state_dict()
        if self.engine is not None:
            self.engine.add_masters_to_state(optimizer, state)
        return state

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, weights_only: Any = None) -> Any:
        """Fabric's loading, with the masters of an optimizer state taken out (into the masters, or the
        parameters) before the optimizer loads it."""
        if isinstance(state, dict) and self.engine is not None:
            for name, obj in state.items():
                if isinstance(obj, Optimizer):
                    state[name] = _MastersFirst(obj, self.engine)
            try:
                return super().load_checkpoint(path, state, strict, weights_only)
            finally:
                for name, obj in state.items():
                    if isinstance(obj, _MastersFirst):
                        state[name] = obj.optimizer
        return super().load_checkpoint(path, state, strict, weights_only)

    @override
    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.remove()
        super().teardown()


class _MastersFirst:
    """An optimizer as Fabric's ``load_checkpoint`` sees it: loading a state pops its masters first."""

    def __init__(self, optimizer: Optimizer, engine: DataParallelEngine) -> None:
        self.optimizer, self.engine = optimizer, engine

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.load_masters_from_state(self.optimizer, state)
        self.optimizer.load_state_dict(state)
