"""What the drop-in equivalence tests (``tests/strategies/test_equivalence.py``) share: strategies by name, a fit
recorder, and a single-process Lightning reference that sees the global batches of N data-parallel ranks.

Every fit runs inside :func:`tests.helpers.workers.run_workers` processes, so Lightning's ``ddp`` and our strategies
use the same torchrun-like environment and the same process group.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero import RobustDDPStrategy, RobustZeroStrategy, ScratchDDPStrategy, ZeroStrategy
from lightning_zero.tools.parity_job import GlobalBatchSampler as GlobalBatchSampler  # re-exported for the tests

OURS = (
    "ddp_scratch", "robust_ddp_scratch", "robust_zero1_scratch", "robust_zero2_scratch", "zero1_scratch",
    "zero2_scratch", "zero3_scratch",
)  # fmt: skip
"""Every registered strategy (the ``_spawn`` variants differ in the launcher only)."""


def make_strategy(name: str, **kwargs: Any) -> Any:
    """``"ddp"`` (Lightning's) or one of :data:`OURS`, with ``kwargs``."""
    if name == "ddp":
        return DDPStrategy(**kwargs)
    if name == "ddp_scratch":
        return ScratchDDPStrategy(**kwargs)
    if name == "robust_ddp_scratch":
        return RobustDDPStrategy(**kwargs)
    if name.startswith("robust_zero"):
        return RobustZeroStrategy(stage=int(name[11]), **kwargs)
    return ZeroStrategy(stage=int(name[4]), **kwargs)


def state_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` as a user reads it after ``fit`` (no gathering of ours), copied."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class Recorder(L.Callback):
    """Every logged metric after each optimizer step and each validation epoch, and the LR at ``on_train_start``."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.val: list[dict[str, float]] = []
        self.lr_at_start: float | None = None
        self.grad_norms: list[dict[str, float]] = []

    def on_train_start(self, trainer, pl_module):
        self.lr_at_start = trainer.optimizers[0].param_groups[0]["lr"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train")})

    def on_validation_epoch_end(self, trainer, pl_module):
        self.val.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val")})


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(((a[k].double() - b[k].double()).abs().max().item() for k in a), default=0.0)
