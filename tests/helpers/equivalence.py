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
from torch.utils.data import DistributedSampler, Sampler

from lightning_zero import RobustDDPStrategy, ScratchDDPStrategy, ZeroStrategy

OURS = ("ddp_scratch", "robust_ddp_scratch", "zero1_scratch", "zero2_scratch", "zero3_scratch")
"""Every registered strategy (the ``_spawn`` variants differ in the launcher only)."""


def make_strategy(name: str, **kwargs: Any) -> Any:
    """``"ddp"`` (Lightning's) or one of :data:`OURS`, with ``kwargs``."""
    if name == "ddp":
        return DDPStrategy(**kwargs)
    if name == "ddp_scratch":
        return ScratchDDPStrategy(**kwargs)
    if name == "robust_ddp_scratch":
        return RobustDDPStrategy(**kwargs)
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


class GlobalBatchSampler(Sampler[list[int]]):
    """One process, the global batches of ``world_size`` ranks: batch k is every rank's k-th batch under Lightning's
    shuffling ``DistributedSampler(seed=seed)``, concatenated in rank order.

    It exposes itself as ``.sampler``: Lightning calls ``set_epoch`` on ``batch_sampler.sampler``.
    """

    def __init__(self, dataset_size: int, world_size: int, batch_size: int, seed: int = 0) -> None:
        self.dataset_size, self.world_size, self.batch_size, self.seed = dataset_size, world_size, batch_size, seed
        self.epoch = 0
        self.sampler = self

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _ranks(self) -> list[list[int]]:
        out = []
        for rank in range(self.world_size):
            sampler = DistributedSampler(
                range(self.dataset_size), num_replicas=self.world_size, rank=rank, shuffle=True, seed=self.seed
            )
            sampler.set_epoch(self.epoch)
            out.append(list(sampler))
        return out

    def __iter__(self):
        ranks = self._ranks()
        for k in range(len(self)):
            yield [i for indices in ranks for i in indices[k * self.batch_size : (k + 1) * self.batch_size]]

    def __len__(self) -> int:
        return -(-len(self._ranks()[0]) // self.batch_size)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(((a[k].double() - b[k].double()).abs().max().item() for k in a), default=0.0)
