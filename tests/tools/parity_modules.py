"""LightningModules for the ``lightning-zero-parity`` tests, named by file path as a user would name a script of
theirs (``tests/tools/parity_modules.py:MLP``).

``MLP`` is data-parallel equivalent (a mean loss, no BatchNorm, no dropout): every correct strategy passes with it.
``BatchNormMLP`` normalizes each rank's 4 samples where the reference normalizes all 8: it must fail. The others are
inputs the check refuses or runs that crash or hang.
"""

from __future__ import annotations

import time

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler


def dataset(samples: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    return TensorDataset(torch.randn(samples, 6, generator=g), torch.randn(samples, 1, generator=g))


class MLP(L.LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.net = self.make_net(hidden)

    def make_net(self, hidden: int) -> nn.Module:
        return nn.Sequential(nn.Linear(6, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=4)


class BatchNormMLP(MLP):
    def make_net(self, hidden: int) -> nn.Module:
        return nn.Sequential(nn.Linear(6, hidden), nn.BatchNorm1d(hidden), nn.Tanh(), nn.Linear(hidden, 1))


class NoData(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class WeightedData(MLP):
    """A custom sampler, which the check does not replay."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=4, sampler=WeightedRandomSampler(torch.ones(64), num_samples=64))


class HangsOnRank1(MLP):
    """Rank 1 never reaches the first gradient all-reduce, so rank 0 waits in it."""

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1:
            time.sleep(3600)
        return super().training_step(batch, batch_idx)


class Crashes(MLP):
    def training_step(self, batch, batch_idx):
        raise RuntimeError("boom in training_step")
