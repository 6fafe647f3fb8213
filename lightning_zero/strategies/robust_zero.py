"""``robust_zero1_scratch`` / ``robust_zero2_scratch``: Byzantine-robust aggregation straight into ZeRO's optimizer
shards.

Runbook::

    import lightning_zero  # registers the names below
    strategy = lightning_zero.RobustZeroStrategy(stage=2, aggregator="trimmed_mean", f=1, workers_per_rank=4)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy)   # n = 2 x 4 = 8 workers
    trainer = Trainer(devices=2, strategy="robust_zero1_scratch")        # the mean: trains as zero1_scratch

Registered names: ``robust_zero1_scratch``, ``robust_zero2_scratch`` and their ``_spawn`` variants. Each rank runs its
workers' forward and backward as under ``robust_ddp_scratch`` (:mod:`lightning_zero.strategies.robust`, whose settings,
metrics and threat model apply); at each optimizer step one all-to-all gives rank ``r`` the columns of its own
optimizer shard of every worker's vector (with several param groups, one range per group and parameter run:
:meth:`~lightning_zero.robust.shards.ColumnLayout.of_groups`), the rule aggregates them ([Note: sharded aggregation]),
and the result is that shard's gradient as it is: the optimizer steps the shard and the updated shards are all-gathered
into the parameters, as under ``zero1_scratch``/``zero2_scratch`` (:mod:`lightning_zero.strategies.zero`, whose
checkpoints, clipping and gradient norms apply). Stage 1 also all-gathers the aggregate into the full ``p.grad``, as
ZeRO-1 keeps the whole averaged gradient; stage 2 keeps only the shard.

Model-state bytes per rank (fp32 AdamW, Ψ trainable parameters, ``N`` ranks, ``k`` workers each): parameters 4Ψ,
gradients 4Ψ (stage 1) or 4Ψ/N (stage 2), optimizer 8Ψ/N, plus the robust rows: this rank's ``k`` worker rows (k 4Ψ,
twice that with worker momentum) and the received shard of all ``n = k N`` rows (``n / N x 4Ψ``).

With ``find_unused_parameters=True`` a parameter no rank used in a window is left untouched by the step and gets no
``p.grad``, as under ``robust_ddp_scratch``. Refused, each by name: ``shard_size`` (hybrid sharding), ``grad_sync``,
``grad_reduction`` and ``grad_accum_dtype`` (the robust rows accumulate every micro-batch locally and are exchanged once
per optimizer step: there is no gradient reduction to tune), ``sharded_aggregation=False``, and the precision settings
``robust_ddp_scratch`` refuses.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import Tensor
from typing_extensions import override

from lightning_zero.robust.engine import CHECKPOINT_KEY
from lightning_zero.strategies.robust import RobustDDPStrategy
from lightning_zero.strategies.zero import ZeroStrategy
from lightning_zero.training.distributed import ROBUST_ZERO_NAMES
from lightning_zero.zero.settings import build_stage12
from lightning_zero.zero.stage12 import ShardedOptimizer

_NO_REDUCTION = ("grad_sync", "grad_reduction", "grad_accum_dtype", "shard_size")
"""ZeRO settings of the gradient reduction, which robust ZeRO replaces."""


def check_settings(stage: Any, settings: dict[str, Any]) -> None:
    """``stage`` and what robust ZeRO refuses among ``settings`` (the strategy's keyword arguments; shared with the
    Hydra schema in :mod:`lightning_zero.tools.config_schema`)."""
    if stage not in (1, 2):
        raise ValueError(
            f"stage={stage!r} is invalid for robust ZeRO: expected 1 or 2 (stage 3 gathers parameters per unit, while"
            " every robust worker needs the whole model for its own forward and backward)"
        )
    name = f"robust_zero{stage}_scratch"
    refused = {k: settings[k] for k in _NO_REDUCTION if settings.get(k) not in (None, "auto")}
    if refused:
        given = ", ".join(f"{k}={v!r}" for k, v in refused.items())
        raise ValueError(
            f"{given} is not supported by {name}: its gradients are not reduced but aggregated once per optimizer"
            " step, each rank on the columns of its optimizer shard; leave it unset"
        )
    if settings.get("sharded_aggregation", True) is not True:
        raise ValueError(
            f"sharded_aggregation={settings['sharded_aggregation']!r} is invalid for {name}: each rank aggregates the"
            " columns of its optimizer shard, so the aggregation is always sharded"
        )
    if settings.get("byzantine_ranks"):
        raise ValueError(
            f"byzantine_ranks={settings['byzantine_ranks']!r} is not supported by {name} yet: use robust_ddp_scratch"
            " (its aggregate goes to the optimizer shards unchecked by the agreement)"
        )


class RobustZeroStrategy(RobustDDPStrategy, ZeroStrategy):
    """ZeRO stage 1 or 2 whose gradient shards are the robust rule's aggregate of every worker's vector.

    Args:
        stage: 1 (optimizer state sharded; the full aggregate in ``p.grad``) or 2 (+ gradients: only the shard).
        aggregator: the rule; it and the other robust settings (``f``, ``aggregator_kwargs``, ``pre_aggregators``,
            ``workers_per_rank``, ``worker_momentum``, ``attack``, ``attack_kwargs``, ``byzantine_workers``, ``seed``,
            ``aggregation_replicas``) as for :class:`~lightning_zero.strategies.robust.RobustDDPStrategy`.
        **kwargs: those, and ``state_dict_type`` and the common settings of
            :class:`~lightning_zero.strategies.zero.ZeroStrategy`, except those refused (module docstring).
    """

    registered_names = ROBUST_ZERO_NAMES
    shards_parameters = False  # as robust_ddp_scratch: the module's own dtype throughout, under "-mixed" too

    def __init__(self, stage: int = 2, aggregator: str = "mean", **kwargs: Any) -> None:
        kwargs.setdefault("sharded_aggregation", True)
        check_settings(stage, kwargs)
        super().__init__(aggregator, stage=stage, **kwargs)
        self.strategy_name = f"robust_zero{stage}_scratch"

    @property
    @override
    def strategy_buffers(self) -> list[Tensor]:
        """The robust rows (:attr:`RobustDDPStrategy.strategy_buffers`) and the ZeRO engine's flat buffers."""
        engine = self.engine
        return self.robust_engine.buffers + (engine.strategy_buffers if engine is not None else [])

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        ZeroStrategy.setup(self, trainer)  # not robust_ddp_scratch's: the ZeRO engine, built by the hook below

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._writes_checked():  # ZeRO's, around robust_ddp_scratch's step (one forward per worker)
            return RobustDDPStrategy.training_step(self, *args, **kwargs)

    @override
    def _build_stage12(self) -> ShardedOptimizer:
        """The ZeRO engine without its gradient reduction, the robust rows over its flat groups' columns, and the
        aggregated shard handed to it."""
        if not self.lightning_module.automatic_optimization:
            raise ValueError(f"{self.strategy_name} needs automatic optimization (automatic_optimization=True)")
        assert self.model is not None
        engine = build_stage12(
            self.settings,
            self.precision_policy,
            self.model,
            self.optimizers[0],
            find_unused_parameters=self.find_unused_parameters,
            reduce_gradients=False,
        )
        groups = [g.params for g in engine.groups]  # the rows' columns of each flat group, in its order
        self.robust_engine.attach(self.model, find_unused_parameters=self.find_unused_parameters, groups=groups)
        assert self.robust_engine.exchange is not None
        self.robust_engine.exchange.sink = engine.set_shard_grads
        return engine

    # ------------------------------------------------------------ checkpoints
    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """ZeRO's (either kind, any world size; the optimizer shards loaded here), then the robust state: Lightning
        does not call ``load_optimizer_state_dict`` for a strategy that restores its optimizer itself."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if CHECKPOINT_KEY in checkpoint and self.robust_engine.grads is not None:
            self.load_robust_state_dict(checkpoint[CHECKPOINT_KEY])
        return checkpoint
