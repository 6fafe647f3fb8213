"""Pipeline parallelism: our runtime against ``torch.distributed.pipelining``, and the measured bubble against theory.

Runbook::

    torchrun --nproc_per_node 2 benchmarks/pipeline.py                                   # defaults below
    torchrun --nproc_per_node 2 benchmarks/pipeline.py --micro-batches 4 --steps 3 --width 64   # smoke

The model is ``--layers`` blocks of ``Linear(width, width) + GELU`` cut evenly into one stage per rank, with an MSE
loss on the last stage; a step is the forwards and backwards of one batch of ``--batch`` samples in
``--micro-batches`` pieces (no optimizer step). For each schedule (GPipe, 1F1B) and micro-batch count, interleaved
step by step after ``--warmup`` untimed steps:

- ``lightning_zero``: :class:`lightning_zero.pipeline.runtime.PipelineStage` running
  :func:`lightning_zero.pipeline.schedule.build`'s actions;
- ``torch``: ``torch.distributed.pipelining.PipelineStage`` with ``ScheduleGPipe`` / ``Schedule1F1B`` on the same
  layers, micro-batches and loss.

A step's time is the slowest rank's (a barrier before each step). The table gives medians, the ratio ours/torch, the
peak bytes autograd saved for backward on stage 0 (``ActivationMeter``, the same count around either side's step),
and the bubble our stages measured (each stage's idle share of the step: ``1 - busy / step``, where busy counts each
action from the moment its input had arrived) beside ``(p - 1) / (m + p - 1)``. Loopback gloo on a 2-core machine
is noisy: compare rows of one run. Each rank uses one thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage as TorchStage
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from lightning_zero.comm import collectives as comm
from lightning_zero.pipeline.runtime import ActivationMeter, PipelineStage
from lightning_zero.pipeline.schedule import bubble_fraction, build
from lightning_zero.pipeline.stages import partition, split_batch

TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def make_layers(n: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(n)))


Step = Callable[[torch.Tensor, torch.Tensor], tuple[list[float], int]]
"""One pipeline step: this rank's busy intervals (ours only) and the peak bytes autograd saved on this stage."""


def ours(layers: nn.Sequential, indices: range, rank: int, world: int, schedule: str, m: int) -> Step:
    stage = PipelineStage(layers, indices, rank, list(range(world)), torch.device("cpu"), measure_activations=True)
    actions = build(schedule, world, m)[rank]

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[list[float], int]:
        pieces = split_batch((x, y), m)
        stage.run(actions, pieces, lambda mb: nn.functional.mse_loss(layers(mb[0]), mb[1]))
        return [t.end - t.ready for t in stage.timeline], stage.meter.peak

    return step


def theirs(layers: nn.Sequential, indices: range, rank: int, world: int, schedule: str, m: int) -> Step:
    submodule = nn.Sequential(*(layers[i] for i in indices))
    stage = TorchStage(submodule, rank, world, torch.device("cpu"))
    pipe = TORCH_SCHEDULES[schedule](stage, n_microbatches=m, loss_fn=nn.functional.mse_loss)
    meter = ActivationMeter()  # the same count as our stage's, around torch's whole step

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[list[float], int]:
        meter.reset(list(submodule.parameters()))
        with meter.counting():
            if rank == 0:
                pipe.step(x)
            elif rank == world - 1:
                pipe.step(target=y)
            else:
                pipe.step()
        return [], meter.peak

    return step


def timed(step: Step, x: torch.Tensor, y: torch.Tensor, layers: nn.Sequential) -> tuple[float, float, int]:
    """The slowest rank's time for one step, this rank's busy time in it (ours only), and its activation peak."""
    dist.barrier()
    start = time.perf_counter()
    busy, peak = step(x, y)
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    layers.zero_grad(set_to_none=True)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item(), sum(busy), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], choices=sorted(TORCH_SCHEDULES))
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layers = make_layers(args.layers, args.width)
    indices = partition(args.layers, world)[rank]
    for i in set(range(args.layers)) - set(indices):
        layers[i] = nn.Identity()  # another stage's: never called
    generator = torch.Generator().manual_seed(1)
    x, y = (
        torch.randn(args.batch, args.width, generator=generator),
        torch.randn(args.batch, args.width, generator=generator),
    )
    if rank == 0:
        print(f"{world} stages, {args.layers} x Linear({args.width}) + GELU, batch {args.batch}, {args.steps} steps")
        print(
            f"{'schedule':>8} {'m':>3} {'ours ms':>9} {'torch ms':>9} {'ratio':>6} {'bubble':>7} {'theory':>7}"
            f" {'act MiB ours':>12} {'act MiB torch':>13}"
        )
    for schedule in args.schedules:
        for m in args.micro_batches:
            runners = {
                "ours": ours(layers, indices, rank, world, schedule, m),
                "torch": theirs(layers, indices, rank, world, schedule, m),
            }
            times: dict[str, list[float]] = {name: [] for name in runners}
            peaks = dict.fromkeys(runners, 0)
            bubbles: list[float] = []
            for step in range(args.warmup + args.steps):
                for name, runner in runners.items():
                    elapsed, busy, peak = timed(runner, x, y, layers)
                    peaks[name] = max(peaks[name], peak)
                    if step >= args.warmup:
                        times[name].append(elapsed)
                        if name == "ours":
                            bubbles.append(1.0 - busy / elapsed)
            bubble = torch.tensor(statistics.median(bubbles))
            dist.all_reduce(bubble)  # the stages' mean
            if rank == 0:  # stage 0 holds the most activations under 1F1B
                a, b = (statistics.median(times[n]) * 1e3 for n in ("ours", "torch"))
                print(
                    f"{schedule:>8} {m:>3} {a:9.1f} {b:9.1f} {a / b:6.2f} {bubble.item() / world:7.3f}"
                    f" {bubble_fraction(world, m):7.3f} {peaks['ours'] / 2**20:12.1f} {peaks['torch'] / 2**20:13.1f}"
                )
    # Both sides train the very same stage modules: one count per rank of their parameters and gradients.
    states = torch.tensor(float(sum(2 * p.numel() * p.element_size() for p in layers.parameters())))
    gathered = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(gathered, states)
    if rank == 0:
        print("model states per rank (parameters + gradients, both sides):", [f"{t / 2**20:.1f} MiB" for t in gathered])
    comm.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
