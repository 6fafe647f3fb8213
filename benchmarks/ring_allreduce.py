"""gloo all-reduce: lightning_zero's ring (:mod:`lightning_zero.comm.ring`) and, with ``--hierarchical``, its
hierarchical all-reduce (:mod:`lightning_zero.comm.hierarchy`) vs the backend's ``dist.all_reduce``.

Runbook (the script starts its own processes, one group per rank count; no torchrun)::

    python benchmarks/ring_allreduce.py                          # 1..128 MiB fp32, 2, 3 and 4 ranks, 7 trials
    python benchmarks/ring_allreduce.py --sizes 16 --ranks 2 --chunk-kib 64 256 1024 4096   # pick CHUNK_BYTES
    python benchmarks/ring_allreduce.py --quick                  # smoke: tiny sizes, 2 ranks
    # 2 nodes x 2 ranks on 1 Gbit/s links: the hierarchy (nodes of LOCAL_WORLD_SIZE ranks) vs gloo's own and the ring
    lightning-zero-netlab --nodes 2 --ranks-per-node 2 --inter-node 1gbit -- python benchmarks/ring_allreduce.py \
        --hierarchical --sizes 0.00390625 0.0625 1 16 64 256 --trials 3

Why: ``collectives.all_reduce`` keeps ``algorithm="native"`` as its default until this measures the ring faster
(see [Note: ring all-reduce]). For every rank count and size, after ``--warmup`` untimed trials, the trials are
interleaved (native, ring, native, ring...) so machine drift hits both alike; every call starts after a barrier, a
trial's time is the slowest rank's, and the table shows the median. Each rank runs one thread: compare rows of the
same run, not across runs (loopback TCP varies up to 2x run to run). Before timing, the ring's result is checked
against the native one on the benchmark data.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_zero.comm import ring
from lightning_zero.comm.collectives import all_reduce

try:  # run as a script, sys.path[0] is benchmarks/; imported from the repo root, it is a namespace package
    from benchmarks.processes import init_gloo, launch_prefix, launched, launched_world, reports, run_ranks
except ImportError:
    from processes import (  # type: ignore[no-redef]
        init_gloo,
        launch_prefix,
        launched,
        launched_world,
        reports,
        run_ranks,
    )

MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 4, 16, 64, 128], help="fp32 tensor, MiB")
    parser.add_argument("--ranks", type=int, nargs="+", default=None, help="process counts (2 3 4; torchrun's world)")
    parser.add_argument("--trials", type=int, default=7, help="timed trials per algorithm and size")
    parser.add_argument("--warmup", type=int, default=1, help="untimed trials per algorithm and size")
    parser.add_argument(
        "--chunk-kib", type=float, nargs="+", default=None, help="ring chunk sizes to compare (default: CHUNK_BYTES)"
    )
    parser.add_argument(
        "--hierarchical", action="store_true", help="also the hierarchical all-reduce (nodes of LOCAL_WORLD_SIZE ranks)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 0.25 and 1 MiB, 2 ranks, 3 trials")
    args = parser.parse_args(argv)
    if args.ranks is None:  # under torchrun (or lightning-zero-netlab), the ranks it started
        args.ranks = [launched_world(0)] if launched() else [2, 3, 4]
    if args.quick:
        args.sizes, args.ranks, args.trials = [0.25, 1], [launched_world(2)], 3
    args.chunks = [int(kib * 1024) for kib in args.chunk_kib] if args.chunk_kib else [ring.CHUNK_BYTES]
    if args.trials < 1 or args.warmup < 0 or min(args.sizes) <= 0 or min(args.ranks) < 2 or min(args.chunks) < 1:
        parser.error("--trials must be >= 1, --warmup >= 0, sizes and chunks > 0, ranks >= 2")
    return args


def algorithms(args: argparse.Namespace) -> list[str]:
    return ["native", *(f"ring {chunk // 1024} KiB" for chunk in args.chunks), *(["hierarchical"] * args.hierarchical)]


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    init_gloo(rank, world, port)
    names = algorithms(args)
    runs = {"native": dist.all_reduce, "hierarchical": partial(all_reduce, algorithm="hierarchical", tag="bench")}
    for name, chunk in zip(names[1:], args.chunks):
        runs[name] = lambda t, chunk=chunk: ring.ring_all_reduce(t, chunk_bytes=chunk, tag="bench")
    generator = torch.Generator().manual_seed(rank)
    times: dict[tuple[float, str], list[float]] = {}
    for size in args.sizes:
        src = torch.randn(int(size * MIB) // 4, generator=generator)
        buffer = torch.empty_like(src)
        expected = src.clone()
        dist.all_reduce(expected)
        for name in names[1:]:
            buffer.copy_(src)
            runs[name](buffer)
            torch.testing.assert_close(buffer, expected, msg=lambda m, name=name: f"{name} != native: {m}")
        for trial in range(args.warmup + args.trials):
            for name in names:  # interleaved
                buffer.copy_(src)  # untimed refill: both reduce in place
                dist.barrier()
                start = time.perf_counter()
                runs[name](buffer)
                elapsed = time.perf_counter() - start
                if trial >= args.warmup:
                    times.setdefault((size, name), []).append(elapsed)
    gathered: list[dict[tuple[float, str], list[float]]] = [{} for _ in range(world)]
    dist.all_gather_object(gathered, times)
    if rank == 0:
        results.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, args: argparse.Namespace) -> dict[tuple[float, str], float]:
    """``{(size, algorithm): median seconds}`` over ``world`` fresh processes; a trial counts its slowest rank."""
    gathered = run_ranks(_worker, world, args)
    return {
        key: statistics.median(max(ts) for ts in zip(*(g[key] for g in gathered), strict=True)) for key in gathered[0]
    }


def report(args: argparse.Namespace, results: dict[int, dict[tuple[float, str], float]]) -> None:
    names = algorithms(args)
    rings = names[1:]
    header = ["ranks", "MiB", *(f"{name} ms" for name in names), *(f"{name} / native" for name in rings)]
    print(f"\nmedian of {args.trials} interleaved trials (slowest rank), {args.warmup} warm-up; fp32, gloo, 1 thread")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" for _ in header) + "|")
    for world, med in results.items():
        for size in args.sizes:
            ms = [f"{1e3 * med[(size, name)]:.2f}" for name in names]
            ratios = [f"{med[(size, name)] / med[(size, 'native')]:.2f}" for name in rings]
            print("| " + " | ".join([str(world), f"{size:g}", *ms, *ratios]) + " |")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sizes = " ".join(f"{s:g}" for s in args.sizes)
    chunks = " ".join(f"{c / 1024:g}" for c in args.chunks)
    if reports():  # under torchrun the other ranks stay quiet
        print(
            f"reproduce: {launch_prefix()} benchmarks/ring_allreduce.py --sizes {sizes}"
            f" --ranks {' '.join(map(str, args.ranks))} --trials {args.trials} --warmup {args.warmup}"
            f" --chunk-kib {chunks}{' --hierarchical' if args.hierarchical else ''}"
        )
        print(f"torch {torch.__version__}, {os.cpu_count()} CPUs", flush=True)
    results = {}
    for world in args.ranks:
        results[world] = measure(world, args)
        print(f"{world} ranks: done, {' and '.join(algorithms(args)[1:])} == native on the benchmark data", flush=True)
    report(args, results)


if __name__ == "__main__":
    main()
