"""What PowerSGD's own arithmetic costs per step on the step-time GPT, against the all-reduce it replaces.

Runbook::

    python benchmarks/powersgd_compute.py            # gpt25m, rank 4, 25 MiB buckets, 1 thread
    python benchmarks/powersgd_compute.py --rank 1 --preset small

Two local ranks (gloo) hold the gradient buckets ``ddp_scratch`` builds for the benchmark GPT
(``benchmarks/gpt.py``) with random values, and time, interleaved over ``--trials`` trials: (a) the plain bucket
all-reduces of one step, (b) one compressed step of ``PowerSGDCompressor`` (``lightning_zero/comm/powersgd.py``;
error feedback and warm start, after ``--warmup`` compressed steps), and (c) within (b), the matrix products alone
(``P = M Q``, ``Q = Mᵀ P``, ``M = P Qᵀ`` on the same shapes, timed apart). It prints medians of the slower
rank: if (b) costs more than (a), compression cannot shorten a step on this machine, however it is overlapped.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

try:  # run as a script, sys.path[0] is benchmarks/; imported from the repo root, it is a namespace package
    from benchmarks.gpt import GPT, PRESETS
    from benchmarks.processes import init_gloo, run_ranks
except ImportError:
    from gpt import GPT, PRESETS  # type: ignore[no-redef]
    from processes import init_gloo, run_ranks  # type: ignore[no-redef]

from lightning_zero.comm import collectives as comm
from lightning_zero.comm.bucketing import assign_buckets
from lightning_zero.comm.powersgd import PowerSGDCompressor, plan_tensors
from lightning_zero.comm.powersgd_config import PowerSGDConfig


def _buckets(preset: str, bucket_size_mb: float) -> list[tuple[torch.Tensor, list[tuple[int, tuple[int, ...]]]]]:
    """``ddp_scratch``'s buckets of the GPT (reverse registration order), as (flat fp32 buffer, members)."""
    params = [p for p in GPT(PRESETS[preset]).parameters() if p.requires_grad][::-1]
    layouts = assign_buckets([p.numel() for p in params], [4] * len(params), [0] * len(params), bucket_size_mb * 2**20)
    out = []
    for layout in layouts:
        members = sorted((offset, tuple(params[i].shape)) for i, offset in zip(layout.indices, layout.offsets))
        out.append((torch.randn(layout.numel), members))
    return out


def _matrices(buckets: list, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(M, Q)`` for every matrix PowerSGD compresses in one step (random values; only the shapes matter)."""
    out = []
    for _, members in buckets:
        for plan in plan_tensors([shape for _, shape in members], rank, 2.0):
            if plan.compress:
                out.append((torch.randn(plan.n, plan.m), torch.randn(plan.m, plan.r)))
    return out


def _matmuls_ms(matrices: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The three products per compressed matrix of one step, alone."""
    start = time.perf_counter()
    for m, q in matrices:
        p = m @ q
        q = m.t() @ p
        m.copy_(p @ q.t())
    return 1e3 * (time.perf_counter() - start)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, results) -> None:
    torch.set_num_threads(args.threads)
    init_gloo(rank, world, port)
    torch.manual_seed(rank)
    buckets = _buckets(args.preset, args.bucket_size_mb)
    compressor = PowerSGDCompressor(PowerSGDConfig.from_options({"rank": args.rank, "start_iter": 0}))
    for _ in range(args.warmup):
        for index, (buffer, members) in enumerate(buckets):
            compressor.all_reduce(index, buffer.normal_(), members)
    matrices = _matrices(buckets, args.rank)
    plain, compressed, matmuls = [], [], []
    for _ in range(args.trials):
        dist.barrier()
        start = time.perf_counter()
        for buffer, _ in buckets:
            comm.all_reduce(buffer, "avg")
        plain.append(1e3 * (time.perf_counter() - start))
        dist.barrier()
        start = time.perf_counter()
        for index, (buffer, members) in enumerate(buckets):
            compressor.all_reduce(index, buffer, members)
        compressed.append(1e3 * (time.perf_counter() - start))
        matmuls.append(_matmuls_ms(matrices))
    slowest = torch.tensor([plain, compressed, matmuls])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        results.put([statistics.median(row) for row in slowest.tolist()])
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpt25m")
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD rank")
    parser.add_argument("--bucket-size-mb", type=float, default=25)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (the step benchmark's: 1)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--trials", type=int, default=7)
    args = parser.parse_args()
    plain, compressed, matmuls = run_ranks(_worker, 2, args)
    print(
        f"{args.preset}, PowerSGD rank {args.rank}, {args.bucket_size_mb:g} MiB buckets, 2 ranks x {args.threads}"
        f" thread(s), median of {args.trials} (slower rank), ms per step:"
    )
    print(f"  plain bucket all-reduces   {plain:8.1f}")
    print(f"  compressed step            {compressed:8.1f}  ({compressed / plain:.2f} x plain)")
    print(f"  of which matrix products   {matmuls:8.1f}")


if __name__ == "__main__":
    main()
