"""gloo collectives: native reduce-scatter/all-gather vs the substitutes in :mod:`lightning_zero.comm.collectives`.

Runbook::

    torchrun --nproc_per_node 2 benchmarks/collectives.py                              # 1..128 MiB, 5 reps
    torchrun --nproc_per_node 2 benchmarks/collectives.py --sizes-mb 1 4 --reps 2       # smoke

Why: on gloo (torch 2.13) the native ``reduce_scatter_tensor`` is clone + full all-reduce + copy and
``all_gather_into_tensor`` allocates a full-size temporary. lightning_zero replaces them on gloo
with an in-place all-reduce then slice, and one broadcast per rank into the preallocated output. This script checks
both claims the shim relies on: the substitutes give the same result, and they are not slower.

For every size, interleaved rep by rep (A B C D E A B C D E ...), after ``--warmup`` untimed reps:

- ``rs native``: ``dist.reduce_scatter_tensor`` (called by its torch 2.13 name ``reduce_scatter_single`` when it
  exists: the old name is a deprecated wrapper around it);
- ``rs lightning_zero``: :func:`lightning_zero.comm.collectives.reduce_scatter`;
- ``ag native``: ``dist.all_gather_into_tensor`` (``all_gather_single``);
- ``ag lightning_zero``: :func:`lightning_zero.comm.collectives.all_gather`;
- ``all_reduce``: plain in-place ``dist.all_reduce``, the reference.

Every call starts after a barrier; a rep's time is the slowest rank's. ``size`` is the full tensor in every row
(reduce-scatter and all-reduce input, all-gather output: the nccl-tests convention, so rows of one size move the
same data), and algorithm bandwidth is ``size / time`` in GB/s (1e9 bytes). Inputs are refilled, untimed, before
every call, because the reduce-scatter substitute reduces its input in place. Runs vary up to 2x run to run on
loopback TCP: compare rows of the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.comm import collectives as comm

try:  # run as a script, sys.path[0] is benchmarks/; imported from the repo root, it is a namespace package
    from benchmarks.processes import launch_prefix
except ImportError:
    from processes import launch_prefix  # type: ignore[no-redef]

MIB = 2**20
# torch 2.13 renamed the tensor-in/tensor-out collectives; the old names warn on every call.
_native_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_native_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

OPS = ("rs native", "rs lightning_zero", "ag native", "ag lightning_zero", "all_reduce")
PAIRS = (("rs native", "rs lightning_zero"), ("ag native", "ag lightning_zero"))


def check_equivalence(world: int, rank: int, seed: int) -> None:
    """Native and substitute agree on random data (bitwise for 2 ranks: a two-term sum does not depend on order)."""
    generator = torch.Generator().manual_seed(seed + rank)  # different data on every rank
    chunk = 12_345  # deliberately not a power of two
    x = torch.randn(world * chunk, generator=generator)

    native_rs = torch.empty(chunk)
    _native_reduce_scatter(native_rs, x.clone())
    ours_rs = torch.empty(chunk)
    comm.reduce_scatter(ours_rs, x.clone())  # consumes (overwrites) its input on gloo
    expected_rs = x.clone()
    dist.all_reduce(expected_rs)
    expected_rs = expected_rs[rank * chunk : (rank + 1) * chunk]

    y = torch.randn(chunk, generator=generator)
    native_ag = torch.empty(world * chunk)
    _native_all_gather(native_ag, y)
    ours_ag = torch.full((world * chunk,), float("nan"))  # NaN: a chunk the substitute forgets cannot pass
    comm.all_gather(ours_ag, y)

    if world == 2:
        assert torch.equal(native_rs, ours_rs), "reduce_scatter: substitute differs from native"
        assert torch.equal(native_rs, expected_rs), "reduce_scatter: native differs from all_reduce + slice"
    else:  # more terms: the reduction order (and so the rounding) may differ between algorithms
        torch.testing.assert_close(ours_rs, native_rs)
    assert torch.equal(native_ag, ours_ag), "all_gather: substitute differs from native"
    assert torch.equal(ours_ag[rank * chunk : (rank + 1) * chunk], y), "all_gather: own chunk misplaced"


def make_ops(numel: int, world: int, src: Tensor) -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
    """``{op: (refill, run)}`` on buffers allocated once per size: only ``run`` is timed."""
    chunk = numel // world
    full_in = torch.empty(numel)  # reduce-scatter / all-reduce input
    rs_out = torch.empty(chunk)
    ag_in = torch.empty(chunk)
    ag_out = torch.empty(numel)

    def refill_full() -> None:
        full_in.copy_(src)

    def refill_chunk() -> None:
        ag_in.copy_(src[:chunk])

    return {
        "rs native": (refill_full, lambda: _native_reduce_scatter(rs_out, full_in)),
        "rs lightning_zero": (refill_full, lambda: comm.reduce_scatter(rs_out, full_in, tag="bench")),
        "ag native": (refill_chunk, lambda: _native_all_gather(ag_out, ag_in)),
        "ag lightning_zero": (refill_chunk, lambda: comm.all_gather(ag_out, ag_in, tag="bench")),
        "all_reduce": (refill_full, lambda: dist.all_reduce(full_in)),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64, 128], help="full tensor, MiB")
    parser.add_argument("--reps", type=int, default=5, help="timed reps per op and size")
    parser.add_argument("--warmup", type=int, default=1, help="untimed reps per op and size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.reps < 1 or args.warmup < 0 or any(s <= 0 for s in args.sizes_mb):
        parser.error("--reps must be >= 1, --warmup >= 0 and every size > 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "LOCAL_WORLD_SIZE" not in os.environ:
        sys.exit("launch with torchrun, e.g.: torchrun --nproc_per_node 2 benchmarks/collectives.py")
    torch.set_num_threads(1)  # 2 ranks on 2 cores
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if rank == 0:
        sizes = " ".join(f"{s:g}" for s in args.sizes_mb)
        print(
            f"reproduce: {launch_prefix(int(os.environ['LOCAL_WORLD_SIZE']))} benchmarks/collectives.py"
            f" --sizes-mb {sizes} --reps {args.reps} --warmup {args.warmup} --seed {args.seed}"
        )
        print(f"torch {torch.__version__}, gloo, {world} ranks x {torch.get_num_threads()} thread, fp32", flush=True)

    check_equivalence(world, rank, args.seed)
    if rank == 0:
        print("equivalence on random data: reduce_scatter and all_gather substitutes == native: OK", flush=True)

    times: dict[tuple[float, str], list[float]] = {}
    generator = torch.Generator().manual_seed(args.seed + rank)
    for size_mb in args.sizes_mb:
        numel = int(size_mb * MIB) // 4 // world * world  # fp32, divisible into world equal chunks
        src = torch.randn(numel, generator=generator)
        ops = make_ops(numel, world, src)
        for rep in range(args.warmup + args.reps):
            for name in OPS:  # interleaved: machine drift hits every op alike
                refill, run = ops[name]
                refill()
                dist.barrier()
                start = time.perf_counter()
                run()
                elapsed = time.perf_counter() - start
                if rep >= args.warmup:
                    times.setdefault((size_mb, name), []).append(elapsed)
        del ops, src  # free this size's buffers before allocating the next

    gathered: list[dict[tuple[float, str], list[float]]] = [{} for _ in range(world)]
    dist.all_gather_object(gathered, times)
    comm.LEDGER.reset()
    if rank == 0:
        report(args, world, gathered)
    dist.barrier()
    dist.destroy_process_group()


def report(args: argparse.Namespace, world: int, gathered: list[dict[tuple[float, str], list[float]]]) -> None:
    print(f"\nmedian of {args.reps} reps (slowest rank), {args.warmup} warm-up rep(s); GB/s = full tensor bytes / time")
    header = f"{'size MiB':>8}  {'op':<18} {'ms':>9} {'GB/s':>6}  {'vs native':>9}  winner"
    print(header)
    print("-" * len(header))
    for size_mb in args.sizes_mb:
        nbytes = int(size_mb * MIB) // 4 // world * world * 4
        # A rep's time is the slowest rank's (strict: every rank ran every rep).
        med = {
            name: statistics.median(max(ts) for ts in zip(*(g[(size_mb, name)] for g in gathered), strict=True))
            for name in OPS
        }
        # Per row: (time relative to the native op, winner note); the note sits on the substitute's row.
        notes: dict[str, tuple[str, str]] = {"all_reduce": ("", "(reference)")}
        for native, ours in PAIRS:
            winner, loser = (ours, native) if med[ours] < med[native] else (native, ours)
            notes[native] = ("1.00x", "")
            notes[ours] = (f"{med[ours] / med[native]:.2f}x", f"{winner}, {med[loser] / med[winner]:.2f}x faster")
        for i, name in enumerate(OPS):
            label = f"{size_mb:g}" if i == 0 else ""
            ratio, winner = notes[name]
            line = (
                f"{label:>8}  {name:<18} {1e3 * med[name]:9.2f} {nbytes / med[name] / 1e9:6.2f}  {ratio:>9}  {winner}"
            )
            print(line.rstrip())


if __name__ == "__main__":
    main()
