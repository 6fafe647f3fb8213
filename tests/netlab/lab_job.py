"""One rank of a job the lab tests run under torchrun: ``fit OUT`` or ``allreduce OUT`` (see test_lab.py)."""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist


def fit(out: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    import lightning_zero  # noqa: F401  (registers ddp_scratch)

    pl.seed_everything(0)
    model = BoringModel()
    trainer = pl.Trainer(
        strategy="ddp_scratch", accelerator="cpu", devices=1, num_nodes=2, max_steps=8, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model)
    if trainer.is_global_zero:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out)


def allreduce(out: str) -> None:
    dist.init_process_group("gloo")
    x = torch.ones(8 << 20)  # 32 MiB of fp32
    dist.all_reduce(torch.ones(1 << 18))  # connections made before the clock starts
    times = []
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        with open(out, "w") as file:
            json.dump({"bytes": x.numel() * x.element_size(), "median_s": statistics.median(times)}, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    {"fit": fit, "allreduce": allreduce}[sys.argv[1]](sys.argv[2])
