"""lightning_zero: data-parallel, ZeRO and pipeline strategies for PyTorch Lightning, on torch.distributed collectives.

Importing this package registers the strategy names with Lightning, so ``Trainer(strategy="ddp_scratch")`` and
``Fabric(strategy="ddp_scratch")`` work (the Fabric classes live in :mod:`lightning_zero.fabric`).
Lightning has no entry point for strategies and its Trainer snapshots the registry when it is built, so the import
must happen before ``Trainer(...)``. Hydra configs that name ``_target_: lightning_zero....`` import it for you.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero import fabric
from lightning_zero.strategies import (
    PipelineStrategy,
    RobustDDPStrategy,
    RobustZeroStrategy,
    ScratchDDPStrategy,
    ScratchParallelStrategy,
    TensorParallelStrategy,
    ZeroStrategy,
)
from lightning_zero.strategies.grad_norm import grad_norm
from lightning_zero.training.preemption import Preempted, PreemptionCheckpoint
from lightning_zero.training.run_stats import RunStats

__version__ = "0.1.0"

ScratchDDPStrategy.register_strategies(StrategyRegistry)
RobustDDPStrategy.register_strategies(StrategyRegistry)
RobustZeroStrategy.register_strategies(StrategyRegistry)
ZeroStrategy.register_strategies(StrategyRegistry)
PipelineStrategy.register_strategies(StrategyRegistry)
TensorParallelStrategy.register_strategies(StrategyRegistry)
fabric.ScratchDDPStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
fabric.RobustDDPStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
fabric.ZeroStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = [
    "PipelineStrategy",
    "Preempted",
    "PreemptionCheckpoint",
    "RobustDDPStrategy",
    "RobustZeroStrategy",
    "RunStats",
    "ScratchDDPStrategy",
    "ScratchParallelStrategy",
    "TensorParallelStrategy",
    "ZeroStrategy",
    "__version__",
    "grad_norm",
]
