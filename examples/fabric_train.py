"""Train the demo's character-level GPT with Lightning Fabric on 2 CPU processes, under any lightning_zero strategy.

Run::

    python examples/fabric_train.py --strategy zero3_scratch              # Fabric's popen launcher: 2 processes
    python examples/fabric_train.py --strategy zero2_scratch_spawn --steps 20
    python examples/fabric_train.py --strategy ddp                         # Lightning's own, to compare

The loop is plain Fabric: ``no_backward_sync`` on the micro-batches before each optimizer step (what they communicate
is the strategy's ``grad_sync`` rule), the global gradient norm clipped, a cosine learning-rate schedule. The popen
launcher re-runs this script for every extra rank, so everything stays under ``if __name__ == "__main__"``, and
``import lightning_zero`` comes before ``Fabric(...)``: it registers the names.
"""

from __future__ import annotations

import argparse

import torch
from lightning.fabric import Fabric
from torch.nn import functional as F

import lightning_zero  # noqa: F401  (registers "ddp_scratch", "zero3_scratch", ... with Fabric)
from lightning_zero.demo import CharTextDataModule
from lightning_zero.demo.model import CharGPT


def train(fabric: Fabric, args: argparse.Namespace) -> None:
    fabric.seed_everything(0)
    data = CharTextDataModule(block_size=64, batch_size=16, max_chars=args.max_chars)
    data.setup()
    loader = fabric.setup_dataloaders(data.train_dataloader())  # a DistributedSampler per rank
    model = CharGPT(data.vocab_size, block_size=64, n_layer=2, n_head=4, n_embd=128, dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    model, optimizer = fabric.setup(model, optimizer)

    batches = iter(loader)
    for step in range(args.steps):
        for micro in range(args.accumulate):
            x, y = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                fabric.backward(loss / args.accumulate)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if step % 10 == 0 or step == args.steps - 1:
            fabric.print(f"step {step:4d}  loss {fabric.all_reduce(loss.detach()).item():.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="zero3_scratch")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--max-chars", type=int, default=200_000, help="characters of text to train on")
    args = parser.parse_args()
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=args.strategy, precision=args.precision)
    fabric.launch(train, args)  # popen: runs train here in every process; spawn: in the spawned ones


if __name__ == "__main__":
    main()
