"""``robust_ddp_scratch``: data parallelism whose gradient average is replaced by a Byzantine-robust rule.

Runbook::

    import lightning_zero
    strategy = lightning_zero.RobustDDPStrategy(aggregator="trimmed_mean", f=2, workers_per_rank=4)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy)   # n = 2 x 4 = 8 workers

Registered names: ``robust_ddp_scratch`` (popen launcher) and ``robust_ddp_scratch_spawn``; both default to
``aggregator="mean"``, ``f=0``, which trains exactly like ``ddp_scratch``.

Threat model: some *workers* may send arbitrary gradients (bugs, bit flips, attackers); the processes' collectives,
the data loader and the code are trusted. Each rank runs ``workers_per_rank`` workers
(:mod:`lightning_zero.robust.workers`); at each optimizer step (once per accumulation window, never per
micro-batch) every rank all-gathers the workers' accumulated gradients into an ``(n, d)`` stack and runs the same
:class:`~lightning_zero.robust.aggregation.RobustAggregator` on it, so all ranks apply the same aggregate.
Non-boundary micro-batches communicate nothing. ``attack=...`` *simulates* Byzantine workers for evaluation.

Logged every optimizer step (``self.log``, on step): ``robust/honest_distance``, ``robust/byzantine_selected`` (for
selection rules), ``robust/nonfinite_dropped``, ``robust/aggregation_ms`` and ``robust/comm_bytes`` (this rank's
all-gather output). The same values are in :attr:`RobustDDPStrategy.last_result`.

The strategy is a thin adapter over :class:`~lightning_zero.robust.engine.RobustEngine` (the worker rows, the rule,
the gathering, the checkpoint state), which Fabric's ``robust_ddp_scratch`` (:mod:`lightning_zero.fabric.robust`)
drives as well; what stays here is the Trainer's: one ``training_step`` call per worker, the backward of each
worker's loss, ``self.log`` of the metrics and the checkpoint hooks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from lightning_zero.byzantine.front_end import ByzantineFrontEnd
from lightning_zero.byzantine.launcher import TrainerLauncher
from lightning_zero.robust.aggregation import StageSpec
from lightning_zero.robust.engine import (
    CHECKPOINT_KEY,
    RobustFrontEnd,
    build_engine,
    check_precision_settings,
    check_workers,
)
from lightning_zero.strategies.base import ScratchParallelStrategy
from lightning_zero.training.distributed import ROBUST_NAMES

__all__ = ["CHECKPOINT_KEY", "RobustDDPStrategy", "check_precision_settings", "check_workers"]


class RobustDDPStrategy(ByzantineFrontEnd, RobustFrontEnd, ScratchParallelStrategy):
    """Data parallelism with a robust aggregation rule over ``n = workers_per_rank x world_size`` workers.

    Args:
        aggregator: the rule: ``mean``, ``median`` (coordinate-wise; even n averages the two middle values),
            ``trimmed_mean``, ``krum``, ``multi_krum``, ``geometric_median``, ``centered_clipping``, ``bulyan``.
        f: Byzantine workers to tolerate. Checked against the rule's bound for ``n`` when the Trainer is built
            (e.g. Krum needs ``n >= 2f + 3``); a violation raises ``ValueError``, f is never lowered silently.
        aggregator_kwargs: the rule's parameters, e.g. ``{"m": 4}`` for ``multi_krum``, ``{"tau": 10.0}``.
        pre_aggregators: applied in order before the rule: ``"nnm"``, ``{"name": "bucketing", "s": 2}``,
            ``{"name": "clip", "c": 1.0}``.
        workers_per_rank: workers per process; each micro-batch is split into this many chunks along dim 0, each
            with its own forward and backward.
        worker_momentum: ``beta`` in ``[0, 1)``; each worker sends ``m <- beta m + (1 - beta) g`` (0: the gradient).
        attack: simulate Byzantine workers (evaluation only): ``sign_flip``, ``gaussian``, ``alie``, ``ipm``,
            ``mimic``, ``nan``, ``inf``, ``label_flip``.
        attack_kwargs: the attack's parameters (``alie`` needs ``z``; ``label_flip`` needs ``num_classes``).
        byzantine_workers: global indices of the simulated Byzantine workers (default: the last ``f``).
        seed: seed of the generator behind ``bucketing`` and the ``gaussian`` attack (same on every rank).
        sharded_aggregation: rank ``r`` receives only columns shard ``r`` of every worker's vector (one all-to-all),
            aggregates them and all-gathers its shard of the aggregate: ``n d / N`` values received per rank instead
            of ``n d``, the same aggregate up to the order of float sums ([Note: sharded aggregation] in
            :mod:`lightning_zero.robust.shards`).
        aggregation_replicas: with ``sharded_aggregation``, ``r`` in ``[1, N]`` ranks aggregate each shard and compare
            digests of their results before anyone applies the step (``AggregationMismatchError`` on every rank
            otherwise; [Note: replicated aggregation]); costs ``r`` times the exchange and the aggregation.
        byzantine_ranks: ``f`` >= 1 turns on the Byzantine ranks mode (``lightning_zero.byzantine``): up to ``f``
            *ranks* may run hostile code (``N >= 3f + 1`` processes); signed messages, each shard aggregated by
            ``2f + 1`` ranks, agreement on every step's inputs. 0: every rank is trusted.
        byzantine_timeout: seconds each round of a step (and each of Lightning's collectives) waits; a rank silent
            past it is left out of that step.
        byzantine_rank_behaviour: evaluation only: ``silent``, ``equivocate``, ``forged_digest``,
            ``wrong_aggregate``, ``wrong_partial``, ``wrong_vote``, ``slow_under``, ``slow_over``, ``crash`` or
            ``alie`` (colluding), played by ``byzantine_behaving_ranks`` (default: the last ``byzantine_ranks``).
        byzantine_behaving_ranks: the ranks that play ``byzantine_rank_behaviour``.
        master_weights: must stay ``False``: the robust pipeline aggregates and steps the module's own parameters.
        **kwargs: see :class:`~lightning_zero.strategies.base.ScratchParallelStrategy`.
    """

    strategy_name = "robust_ddp_scratch"
    registered_names = ROBUST_NAMES

    def __init__(
        self,
        aggregator: str = "mean",
        f: int = 0,
        aggregator_kwargs: Mapping[str, Any] | None = None,
        pre_aggregators: Sequence[StageSpec] = (),
        workers_per_rank: int = 1,
        worker_momentum: float = 0.0,
        attack: str | None = None,
        attack_kwargs: Mapping[str, Any] | None = None,
        byzantine_workers: Sequence[int] | None = None,
        seed: int = 0,
        sharded_aggregation: bool = False,
        aggregation_replicas: int = 1,
        byzantine_ranks: int = 0,
        byzantine_timeout: float = 10.0,
        byzantine_rank_behaviour: str | None = None,
        byzantine_behaving_ranks: Sequence[int] | None = None,
        master_weights: bool = False,
        **kwargs: Any,
    ) -> None:
        self._check_byzantine(
            aggregator, aggregation_replicas, workers_per_rank, byzantine_ranks, byzantine_timeout,
            byzantine_rank_behaviour, byzantine_behaving_ranks,
        )  # fmt: skip
        self.robust_engine = build_engine(
            aggregator,
            f=f,
            aggregator_kwargs=aggregator_kwargs,
            pre_aggregators=pre_aggregators,
            workers_per_rank=workers_per_rank,
            worker_momentum=worker_momentum,
            attack=attack,
            attack_kwargs=attack_kwargs,
            byzantine_workers=byzantine_workers,
            seed=seed,
            sharded_aggregation=sharded_aggregation,
            aggregation_replicas=aggregation_replicas,
        )
        self._attach_byzantine()
        super().__init__(master_weights=master_weights, **kwargs)
        self._worker_losses: list[Tensor] = []

    @property
    @override
    def strategy_buffers(self) -> list[Tensor]:
        """The worker rows (and momentum rows) while fitting."""
        return self.robust_engine.buffers

    @override
    def _check_robust_settings(self) -> None:
        self._check_byzantine_world()
        super()._check_robust_settings()

    @override
    def _configure_launcher(self) -> None:
        self._check_robust_settings()  # the Trainer is being built: no process has started yet
        super()._configure_launcher()
        self._launch_without_observer(_SubprocessScriptLauncher, TrainerLauncher)
        self._check_precision()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._setup_replicas(trainer)
        assert self.lightning_module is not None
        self._tolerant_metrics(self.lightning_module)
        if trainer.state.fn == TrainerFn.FITTING:
            if not self.lightning_module.automatic_optimization:
                raise ValueError("robust_ddp_scratch needs automatic optimization (automatic_optimization=True)")
            assert self.model is not None
            self.robust_engine.attach(self.model, find_unused_parameters=self.find_unused_parameters)
            self._record_trainable()
            self.setup_optimizers(trainer)
        self._setup_precision(trainer, cast_module=False)  # the shard-aware loss scaler; no casts (no masters)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def _sync_states(self, module: torch.nn.Module) -> None:
        """At a ``validate`` or ``test`` after a fit whose protocol still runs, only rank 0's buffers, tolerantly:
        the parameters are the step protocol's, the same on every honest rank, and through gloo a crashed rank would
        fail the broadcast. A fit starts a new run: rank 0's parameters and buffers, as torch DDP's constructor."""
        assert self.lightning_module is not None
        if self._tolerant() is not None and self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            self._sync_buffers(module)
        else:
            super()._sync_states(module)

    # ------------------------------------------------------------ forward: one call per worker
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._check_trainable()
        batch, rest = args[0], args[1:]
        with self._buffer_sync():  # once per step, not per worker: the workers are one DDP forward
            chunks = self.robust_engine.worker_chunks(batch)
            outputs = [ParallelStrategy.training_step(self, chunk, *rest, **kwargs) for chunk in chunks]
        return self._combine(outputs)

    def _combine(self, outputs: list[Any]) -> Any:
        """The workers' outputs as one: the mean loss (for logging and Lightning's bookkeeping)."""
        losses = [out["loss"] if isinstance(out, Mapping) else out for out in outputs]
        if all(loss is None for loss in losses):
            self._worker_losses = []
            return None
        if any(not isinstance(loss, Tensor) for loss in losses):
            raise ValueError("with workers_per_rank > 1 every worker's training_step must return a loss, or all None")
        self._worker_losses = losses
        mean = torch.stack(losses).mean() if len(losses) > 1 else losses[0]
        return {**outputs[-1], "loss": mean} if isinstance(outputs[-1], Mapping) else mean

    # ------------------------------------------------------------ backward: one per worker, then aggregate
    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        module = self.lightning_module
        assert module is not None
        losses, self._worker_losses = self._worker_losses, []
        if not losses:
            raise RuntimeError("robust_ddp_scratch runs backward on the losses of its own training_step only")
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        # Lightning divides the loss by accumulate_grad_batches; each worker's loss gets the same scale, and the
        # loss scale of 16-mixed (pre_backward applied it to closure_loss only, which is not differentiated here).
        scale = 1.0 / module.trainer.accumulate_grad_batches
        scaler = getattr(self.precision_plugin, "scaler", None)
        boundary = not self._backward_sync_blocked  # non-boundary micro-batches: accumulate into the rows only
        for j, loss in enumerate(losses):
            with self.robust_engine.worker_backward(j):
                loss = scaler.scale(loss * scale) if scaler else loss * scale
                self.precision_plugin.backward(loss, module, optimizer, *args, **kwargs)
            if boundary:  # sharded: worker j's exchange overlaps the next workers' backward
                self.robust_engine.send(j)
        if boundary:
            metrics = {**self.robust_engine.aggregate(), **self.byzantine_metrics()}
            module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        return self.precision_plugin.post_backward(closure_loss, module)

    # ------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if "optimizer_states" in checkpoint:  # not for weights-only checkpoints
            checkpoint[CHECKPOINT_KEY] = self.robust_state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if CHECKPOINT_KEY in checkpoint:
            self.load_robust_state_dict(checkpoint[CHECKPOINT_KEY])

    @override
    def teardown(self) -> None:
        # The worker rows stay, like the optimizer's state: momentum rows belong in a checkpoint saved after fit.
        self._worker_losses = []
        self.robust_engine.remove()
        self._revert_layer_sync()
        super().teardown()
