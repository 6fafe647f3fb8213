"""``robust_ddp_scratch`` under Fabric: the engine of the Trainer's ``robust_ddp_scratch``
(:mod:`lightning_zero.robust.engine`).

Runbook::

    import lightning_zero  # registers the names with Fabric too
    strategy = lightning_zero.fabric.RobustDDPStrategy("trimmed_mean", f=1, workers_per_rank=2)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)  # n = 2 x 2 workers; bounds checked here
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    with fabric.no_backward_sync(model, enabled=not boundary):  # accumulation: nothing is ever sent per micro-batch
        for chunk in fabric.strategy.worker_batches(batch):     # one forward and backward per worker
            fabric.backward(loss_fn(model(chunk)))
    fabric.clip_gradients(model, optimizer, max_norm=1.0)      # clips the aggregate
    optimizer.step()
    fabric.log_dict(fabric.strategy.metrics)                   # robust/honest_distance, ... of this step

With ``workers_per_rank=1`` (the default) a plain ``fabric.backward(loss)`` is worker 0's backward. Each backward
accumulates into its worker's row; the rows are aggregated once per optimizer step, lazily, by the first of
``fabric.clip_gradients`` / ``optimizer.step()`` (:meth:`ScratchFabricStrategy._before_step`): every rank
all-gathers the ``(n, d)`` stack and runs the same rule, and every ``p.grad`` becomes a view of the aggregate. A step
with no backward since the last one aggregates nothing. One model: setting up another (a fresh run on the same
Fabric) gives the strategy new worker rows over its parameters. The settings, threat model and metrics are the Trainer's
(:mod:`lightning_zero.strategies.robust`); the metrics are not logged for you (Fabric has no ``self.log``):
:attr:`RobustDDPStrategy.metrics` holds the last step's.

Precision: as under the Trainer, the module's own parameters are aggregated and stepped (no master weights). Under
``16-mixed`` Fabric's precision plugin scales each ``fabric.backward``'s loss, so the rows, the rule and the
aggregate see scaled gradients (rules with absolute thresholds, ``clip``'s ``c`` and ``centered_clipping``'s
``tau``, then act on the scaled values, as under the Trainer); clipping and the step unscale the aggregate.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.byzantine.front_end import SETTINGS as BYZANTINE_SETTINGS
from lightning_zero.byzantine.front_end import ByzantineFrontEnd
from lightning_zero.byzantine.launcher import FabricLauncher
from lightning_zero.fabric.base import ScratchFabricStrategy
from lightning_zero.robust.engine import CHECKPOINT_KEY, SETTINGS, RobustEngine, RobustFrontEnd, build_engine
from lightning_zero.training.distributed import ROBUST_NAMES


class RobustDDPStrategy(ByzantineFrontEnd, RobustFrontEnd, ScratchFabricStrategy):
    """Fabric's ``robust_ddp_scratch``.

    Args:
        aggregator: the rule; it and ``f``, ``aggregator_kwargs``, ``pre_aggregators``, ``workers_per_rank``,
            ``worker_momentum``, ``attack``, ``attack_kwargs``, ``byzantine_workers``, ``seed``,
            ``sharded_aggregation``, ``aggregation_replicas`` and the Byzantine ranks mode's ``byzantine_ranks``,
            ``byzantine_timeout``, ``byzantine_rank_behaviour``, ``byzantine_behaving_ranks`` as for the Trainer's
            :class:`~lightning_zero.strategies.robust.RobustDDPStrategy`, with the same checks: the names when the
            strategy is built, the rule's bound for ``n`` and the mode's ``N >= 3f + 1`` when Fabric is.
        master_weights: must stay ``False``: the robust pipeline aggregates and steps the module's own parameters.
        **kwargs: those settings, and those of :class:`~lightning_zero.fabric.base.ScratchFabricStrategy`.
    """

    strategy_name = "robust_ddp_scratch"
    registered_names = ROBUST_NAMES

    def __init__(self, aggregator: str = "mean", master_weights: bool = False, **kwargs: Any) -> None:
        robust = {name: kwargs.pop(name) for name in SETTINGS if name in kwargs}
        byzantine = {name: kwargs.pop(name) for name in BYZANTINE_SETTINGS if name in kwargs}
        self._check_byzantine(
            aggregator, robust.get("aggregation_replicas", 1), robust.get("workers_per_rank", 1), **byzantine
        )
        self.engine = build_engine(aggregator, **robust)
        self._attach_byzantine()
        super().__init__(master_weights=master_weights, **kwargs)
        self._worker: int | None = None  # the local worker of the current worker_batches iteration

    @property
    def robust_engine(self) -> RobustEngine:
        """The robust engine: this strategy's gradient engine (``self.engine``)."""
        return self.engine

    @property
    def metrics(self) -> dict[str, float]:
        """The last optimizer step's ``robust/*`` metrics (and ``byzantine/*`` with ``byzantine_ranks``), those the
        Trainer strategy logs (empty before the first step): ``fabric.log_dict(fabric.strategy.metrics)``."""
        return {**self.engine.last_metrics, **self.byzantine_metrics()} if self.engine.last_metrics else {}

    @override
    def _check_robust_settings(self) -> None:
        self._check_byzantine_world()
        super()._check_robust_settings()

    @override
    def _configure_launcher(self) -> None:
        self._check_robust_settings()  # Fabric is being built: no process has started yet
        super()._configure_launcher()
        self._launch_without_observer(_SubprocessScriptLauncher, FabricLauncher)
        self._check_precision()

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        self._setup_replica(module)
        self._tolerant_metrics(module)
        self.engine.attach(module, find_unused_parameters=self.find_unused_parameters)
        return module

    # ------------------------------------------------------------ forward and backward: one per worker
    def worker_batches(self, batch: Any) -> Generator[Any, None, None]:
        """This rank's micro-batch as one chunk per worker (split along dim 0; ``attack="label_flip"`` flips the
        Byzantine workers' labels); each ``fabric.backward`` inside an iteration is that worker's."""
        for j, chunk in enumerate(self.engine.worker_chunks(batch)):
            if j:  # the workers are one DDP forward: rank 0's buffers are broadcast before the first worker's only
                self._forward_param_sync = False
            self._worker = j
            try:
                yield chunk
            finally:
                self._worker = None

    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        worker = self._worker
        if worker is None:
            if self.workers_per_rank > 1:
                raise ValueError(
                    f"robust_ddp_scratch with workers_per_rank={self.workers_per_rank} runs one backward per worker:"
                    " call fabric.backward inside `for chunk in fabric.strategy.worker_batches(batch):`, on the loss"
                    " of model(chunk)"
                )
            worker = 0
        with self.engine.worker_backward(worker):
            super().backward(tensor, module, *args, **kwargs)

    # ------------------------------------------------------------ the optimizer step
    @override
    def _before_step(self, optimizer: Optimizer) -> None:
        if self.engine.window_open:  # not after a step without backward, nor for a second optimizer of the window
            self.engine.aggregate()

    # ------------------------------------------------------------ checkpoints
    def _strategy_state(self) -> dict[str, Any]:
        """The robust aggregation state for a checkpoint (a collective: every rank must call it)."""
        return {CHECKPOINT_KEY: self.robust_state_dict()}

    def _load_strategy_state(self, checkpoint: dict[str, Any]) -> None:
        """Take the robust aggregation state out of a loaded checkpoint, if it has one."""
        state = checkpoint.pop(CHECKPOINT_KEY, None)
        if state is not None:
            self.load_robust_state_dict(state)

    @override
    def _remove_engine(self) -> None:
        self.engine.remove()  # the engine outlives the run: its settings, and the momentum rows for a checkpoint

    @override
    def teardown(self) -> None:
        self._worker = None
        super().teardown()
