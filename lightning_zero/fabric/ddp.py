"""``ddp_scratch`` under Fabric: the engine of the Trainer's ``ddp_scratch`` (:mod:`lightning_zero.dp.engine`).

Runbook::

    import lightning_zero  # registers the names with Fabric too
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp_scratch")
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    with fabric.no_backward_sync(model, enabled=not boundary):  # accumulates, communicates nothing
        fabric.backward(loss)

The module is not wrapped: gradients are averaged by autograd hooks while backward runs. With
``grad_compression="powersgd"`` ``fabric.save`` carries every rank's compressor state (``fabric.load`` puts it back;
a checkpoint without it leaves a fresh compressor), as the Trainer's ``ddp_scratch`` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.comm.bucketing import DEFAULT_BUCKET_SIZE_MB, first_bucket_cap_bytes
from lightning_zero.comm.hierarchy import check_algorithm
from lightning_zero.comm.link_model import resolve_link_model
from lightning_zero.comm.powersgd import CHECKPOINT_KEY
from lightning_zero.comm.powersgd_config import compression_config
from lightning_zero.dp.engine import DataParallelEngine
from lightning_zero.fabric.base import ScratchFabricStrategy
from lightning_zero.training.distributed import DDP_NAMES, check_bucket_size


class ScratchDDPStrategy(ScratchFabricStrategy):
    """Fabric's ``ddp_scratch``.

    Args:
        bucket_size_mb: cap of one gradient bucket in MiB (> 0).
        all_reduce_algorithm: ``"auto"`` (default), ``"native"``, ``"ring"`` or ``"hierarchical"``: how the buckets
            are all-reduced. ``"auto"`` takes the hierarchical all-reduce ([Note: hierarchical all-reduce] in
            ``lightning_zero/comm/hierarchy.py``) on gloo for the buckets the link model puts it faster for, when the
            job spans several nodes of several processes each, else the backend's own.
        link_model: the network's levels for ``"auto"`` ([Note: link model] in ``lightning_zero/comm/link_model.py``):
            a mapping of ``inter_node`` (and ``intra_node``) to ``alpha_s`` and ``beta_s_per_byte`` or ``bandwidth``,
            or the path of a ``lightning-zero-netlab --check --json`` file. ``None`` (default): the network lab's.
        grad_compression: gradient compression (``None`` or ``"powersgd"``), as for the Trainer's
            :class:`~lightning_zero.strategies.ddp.ScratchDDPStrategy`.
        powersgd: PowerSGD's settings, as for the Trainer's strategy.
        **kwargs: see :class:`~lightning_zero.fabric.base.ScratchFabricStrategy`.
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
        self.engine: DataParallelEngine | None = None

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        self._setup_replica(module)
        self.engine = DataParallelEngine(
            module,
            self.precision_policy,
            bucket_cap_bytes=int(self.bucket_size_mb * 2**20),
            first_bucket_cap_bytes=first_bucket_cap_bytes(self.bucket_size_mb),
            find_unused_parameters=self.find_unused_parameters,
            compression=self.compression,
            all_reduce_algorithm=self.all_reduce_algorithm,
            ranks_per_node=self.num_processes,
            link_model=self.link_model,
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
    def _load_optimizer_state(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        """The masters of the state first (into the masters, or the parameters), then the optimizer's own state."""
        if self.engine is not None:
            self.engine.load_masters_from_state(optimizer, state)
        optimizer.load_state_dict(state)

    # ------------------------------------------------------------ checkpoints
    @override
    def _strategy_state(self) -> dict[str, Any]:
        """Every rank's compressor state, with compression (a collective: every rank must call it)."""
        return self.engine.compressor_state() if self.engine is not None else {}

    @override
    def _load_strategy_state(self, checkpoint: dict[str, Any]) -> None:
        """The compressor's state, if the checkpoint has it (popped either way, so it is not handed back)."""
        state = checkpoint.pop(CHECKPOINT_KEY, None)
        if state is not None and self.engine is not None:
            self.engine.load_compressor_state({CHECKPOINT_KEY: state})
