"""Lightning Fabric front ends of the strategies, on the engines the Trainer strategies use.

``import lightning_zero`` registers their names in Fabric's registry: ``Fabric(strategy="zero3_scratch")``.
"""

from lightning_zero.fabric.base import ScratchFabricStrategy
from lightning_zero.fabric.ddp import ScratchDDPStrategy
from lightning_zero.fabric.robust import RobustDDPStrategy
from lightning_zero.fabric.zero import ZeroStrategy

__all__ = ["RobustDDPStrategy", "ScratchDDPStrategy", "ScratchFabricStrategy", "ZeroStrategy"]
