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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from lightning_zero.comm import collectives as comm
from lightning_zero.dp.unused import unused_error
from lightning_zero.robust.aggregation import AggregationResult, RobustAggregator, StageSpec
from lightning_zero.robust.attacks import flip_labels
from lightning_zero.robust.workers import WorkerGradients, split_batch
from lightning_zero.strategies.base import ScratchParallelStrategy
from lightning_zero.training.distributed import ROBUST_NAMES

CHECKPOINT_KEY = "robust_aggregation"
"""The checkpoint entry holding the worker momentum (all ``n`` rows), the rule's centre and the generator state."""


def check_workers(workers_per_rank: Any, worker_momentum: Any) -> None:
    """The worker settings (shared with the Hydra schema in :mod:`lightning_zero.tools.config`)."""
    if isinstance(workers_per_rank, bool) or not isinstance(workers_per_rank, int) or workers_per_rank < 1:
        raise ValueError(f"workers_per_rank={workers_per_rank!r} is invalid: expected an integer >= 1")
    if not 0 <= worker_momentum < 1:
        raise ValueError(f"worker_momentum={worker_momentum!r} is invalid: expected a number in [0, 1)")


def check_precision_settings(
    param_dtype: Any = "auto", reduce_dtype: Any = "auto", master_weights: bool = False, cast_module: bool = False
) -> None:
    """The aggregation runs in the parameters' dtype, on the parameters themselves: no master copies, no cast of
    the module, no separate communication dtype (shared with the Hydra schema in :mod:`lightning_zero.tools.config`)."""
    if master_weights or cast_module or param_dtype not in ("auto", None):
        raise ValueError(
            "robust_ddp_scratch keeps no fp32 master weights: leave master_weights=False, cast_module=False and"
            " param_dtype='auto' (under any precision the optimizer then updates the module's own parameters, as"
            " under Lightning's ddp)"
        )
    if reduce_dtype not in ("auto", None):
        raise ValueError(
            f"reduce_dtype={reduce_dtype} is not supported by robust_ddp_scratch: its workers' rows are all-gathered in"
            " the parameters' dtype; leave it 'auto'"
        )


class RobustDDPStrategy(ScratchParallelStrategy):
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
        master_weights: bool = False,
        **kwargs: Any,
    ) -> None:
        check_workers(workers_per_rank, worker_momentum)
        self.aggregator = RobustAggregator(
            aggregator, f, aggregator_kwargs, pre_aggregators, attack, attack_kwargs, byzantine_workers, seed
        )
        super().__init__(master_weights=master_weights, **kwargs)
        self.workers_per_rank = workers_per_rank
        self.worker_momentum = worker_momentum
        self.last_result: AggregationResult | None = None
        self._grads: WorkerGradients | None = None
        self._worker_losses: list[Tensor] = []
        self._window_open = False

    @property
    def num_workers(self) -> int:
        """``n``: every process's workers together."""
        return self.workers_per_rank * self.num_nodes * self.num_processes

    @property
    @override
    def strategy_buffers(self) -> list[Tensor]:
        """The worker rows (and momentum rows) while fitting."""
        return self._grads.buffers if self._grads is not None else []

    @override
    def _configure_launcher(self) -> None:
        self.aggregator.validate(self.num_workers)  # the Trainer is being built: no process has started yet
        super()._configure_launcher()
        self._check_precision()

    def _check_precision(self) -> None:
        check_precision_settings(**self._precision_settings)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._setup_replicas(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            if not self.lightning_module.automatic_optimization:
                raise ValueError("robust_ddp_scratch needs automatic optimization (automatic_optimization=True)")
            named = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
            params, names = [p for _, p in named], [name for name, _ in named]
            self._grads = WorkerGradients(params, self.workers_per_rank, self.worker_momentum, names)
            self._record_trainable()
            self.setup_optimizers(trainer)
        self._setup_precision(trainer, cast_module=False)  # the shard-aware loss scaler; no casts (no masters)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    # ------------------------------------------------------------ forward: one call per worker
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._check_trainable()
        batch, rest = args[0], args[1:]
        first = self.global_rank * self.workers_per_rank
        outputs = []
        with self._buffer_sync():  # once per step, not per worker: the workers are one DDP forward
            for j, chunk in enumerate(split_batch(batch, self.workers_per_rank)):
                if self.aggregator.data_attack and first + j in self.aggregator.byzantine:
                    chunk = self._flip_labels(chunk)
                outputs.append(ParallelStrategy.training_step(self, chunk, *rest, **kwargs))
        return self._combine(outputs)

    def _flip_labels(self, chunk: Any) -> Any:
        if not (isinstance(chunk, (list, tuple)) and len(chunk) == 2 and isinstance(chunk[1], Tensor)):
            raise ValueError("attack='label_flip' needs (inputs, labels) batches")
        return type(chunk)((chunk[0], flip_labels(chunk[1], **self.aggregator.attack_kwargs)))

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
        grads, module = self._grads, self.lightning_module
        assert grads is not None and module is not None
        losses, self._worker_losses = self._worker_losses, []
        if not losses:
            raise RuntimeError("robust_ddp_scratch runs backward on the losses of its own training_step only")
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        if not self._window_open:
            grads.rows.zero_()
            grads.used.end_window()
            self._window_open = True
        # Lightning divides the loss by accumulate_grad_batches; each worker's loss gets the same scale, and the
        # loss scale of 16-mixed (pre_backward applied it to closure_loss only, which is not differentiated here).
        scale = 1.0 / self.lightning_module.trainer.accumulate_grad_batches
        scaler = getattr(self.precision_plugin, "scaler", None)
        for j, loss in enumerate(losses):
            grads.bind(j)
            loss = loss * scale
            self.precision_plugin.backward(scaler.scale(loss) if scaler else loss, module, optimizer, *args, **kwargs)
            grads.collect(j)
        if not self._backward_sync_blocked:  # non-boundary micro-batches: accumulate into the rows only
            self._aggregate()
        return self.precision_plugin.post_backward(closure_loss, module)

    def _unused_everywhere(self) -> set[str]:
        """Parameters without a gradient in this window: an error, or with ``find_unused_parameters`` their rows
        stay zero and the parameters no rank used get ``p.grad = None`` (as under torch DDP)."""
        grads = self._grads
        assert grads is not None
        if not self.find_unused_parameters:
            unused = grads.used.unused_in_window()
            if unused:
                raise unused_error(unused)
            return set()
        return grads.used.find_unused_everywhere(grads.rows.device)

    def _gather_rows(self, rows: Tensor, tag: str) -> Tensor:
        """This rank's ``(k, d)`` worker rows -> every worker's ``(n, d)``, in global worker order (one process: the
        rows themselves)."""
        if comm.world_size() == 1:
            return rows
        stack = rows.new_empty(self.num_workers, rows.shape[1])
        comm.all_gather(stack, rows, tag=tag)
        return stack

    def _aggregate(self) -> None:
        grads = self._grads
        assert grads is not None
        unused = self._unused_everywhere()
        stack = self._gather_rows(grads.vectors(), tag="worker_grads")
        result = self.aggregator(stack)
        grads.set_grads(result.vector, skip=unused)
        self._window_open = False
        self.last_result = result
        comm_bytes = stack.numel() * stack.element_size() if comm.world_size() > 1 else 0
        metrics = {
            "robust/honest_distance": result.honest_distance,
            "robust/nonfinite_dropped": float(result.dropped),
            "robust/aggregation_ms": result.seconds * 1e3,
            "robust/comm_bytes": float(comm_bytes),
        }
        if result.byzantine_selected is not None:
            metrics["robust/byzantine_selected"] = result.byzantine_selected
        self.lightning_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    # ------------------------------------------------------------ checkpoints
    def robust_state_dict(self) -> dict[str, Any]:
        """The aggregator's state and every worker's momentum row (a collective: every rank must call it)."""
        state: dict[str, Any] = {"num_workers": self.num_workers, **self.aggregator.state_dict()}
        grads = self._grads
        momentum = grads.momentum_rows if grads is not None else None
        if momentum is not None:
            momentum = self._gather_rows(momentum, tag="checkpoint").cpu().clone()
        state["worker_momentum"] = momentum
        return state

    def load_robust_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["num_workers"] != self.num_workers:
            raise ValueError(
                f"the checkpoint's robust aggregation state is for n={state['num_workers']} workers, this run has"
                f" n={self.num_workers}: resume with the same devices x num_nodes x workers_per_rank"
            )
        self.aggregator.load_state_dict(state)
        momentum, grads = state.get("worker_momentum"), self._grads
        if momentum is not None and grads is not None and grads.momentum_rows is not None:
            first = self.global_rank * self.workers_per_rank
            grads.momentum_rows.copy_(momentum[first : first + self.workers_per_rank])

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
        self._window_open = False
        if self._grads is not None:
            self._grads.remove()
        self._revert_layer_sync()
        super().teardown()
