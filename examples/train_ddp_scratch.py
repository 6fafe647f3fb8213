"""Train a small regression MLP on 2 CPU processes with ``ddp_scratch``.

Run::

    python examples/train_ddp_scratch.py                     # 2 processes via Lightning's popen launcher
    python examples/train_ddp_scratch.py --devices 1         # one process
    torchrun --nproc_per_node 2 examples/train_ddp_scratch.py

It ends with one line from rank 0, e.g. ``final val_mse=0.3165 after 80 optimizer steps, median step 4.1 ms``
(under 10 s on 2 CPU cores), and leaves ``run_stats.json`` (step times, model-state bytes per rank) in the
current directory.

Lightning's popen launcher re-runs this script for every extra rank, so everything below stays under
``if __name__ == "__main__"``. ``import lightning_zero`` must come before ``Trainer(...)``: it registers the name.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero  # registers "ddp_scratch"


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 1))
        self.val_mse = torchmetrics.MeanSquaredError()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_mse.update(self.net(x), y)
        self.log("val_mse", self.val_mse, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def make_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.linspace(-1, 1, 16)
    return TensorDataset(x, (x @ w + 0.1 * torch.randn(n, generator=g)).unsqueeze(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--accumulate-grad-batches", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(1)  # one thread per process: 2 processes on 2 cores
    L.seed_everything(0)
    run_stats = lightning_zero.RunStats(output_dir=".", log_step_time=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp_scratch",
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate_grad_batches,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        callbacks=[run_stats],
    )
    model = Regressor()
    trainer.fit(
        model,
        DataLoader(make_data(2048, seed=0), batch_size=32),
        DataLoader(make_data(512, seed=1), batch_size=64),
    )
    if trainer.is_global_zero:
        val_mse, step_ms = trainer.callback_metrics["val_mse"], run_stats.stats["median_step_time_ms"]
        print(f"final val_mse={val_mse:.4f} after {trainer.global_step} optimizer steps, median step {step_ms:.1f} ms")
    if torch.distributed.is_initialized():  # a gloo group alive at interpreter exit can abort the process
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
