"""Lightning ``Strategy`` subclasses of lightning_zero, one module per strategy."""

from lightning_zero.strategies.base import ScratchParallelStrategy
from lightning_zero.strategies.ddp import ScratchDDPStrategy
from lightning_zero.strategies.pipeline import PipelineStrategy
from lightning_zero.strategies.robust import RobustDDPStrategy
from lightning_zero.strategies.robust_zero import RobustZeroStrategy
from lightning_zero.strategies.tensor_parallel import TensorParallelStrategy
from lightning_zero.strategies.zero import ZeroStrategy

__all__ = [
    "PipelineStrategy",
    "RobustDDPStrategy",
    "RobustZeroStrategy",
    "ScratchDDPStrategy",
    "ScratchParallelStrategy",
    "TensorParallelStrategy",
    "ZeroStrategy",
]
