"""Optimizer-step time of every lightning_zero strategy on one CUDA device (world size 1), against Lightning's ddp.

``benchmarks/step_time.py`` times CPU ranks under gloo (``accelerator="cpu"``, launched by torchrun); this is its
one-GPU companion, for a machine with a single GPU::

    python benchmarks/gpu_step_time.py                                  # gpt25m, 32-true and bf16-mixed
    python benchmarks/gpu_step_time.py --preset tiny --steps 6 --warmup 2 --rounds 1   # smoke run

At world size 1 no collective moves data (``lightning_zero.comm.collectives`` copies locally), so the figures are each
strategy's per-step overhead on the GPU (hooks, flat buffers, gathers/frees of ZeRO-3 units, master weights, casts)
against Lightning's ``ddp`` (torch ``DistributedDataParallel``) on the same model, data and ``AdamW(fused=True)``.

Protocol: one process; each round fits every candidate in turn (A B C A B C ...) under each ``--precision`` for
``--steps`` optimizer steps of ``benchmarks/gpt.py``'s ``GPTLightningModule``. A step is timed from
``on_train_batch_start`` to ``on_train_batch_end`` with ``torch.cuda.synchronize()`` at both ends (CUDA kernels run
asynchronously); the first ``--warmup`` steps of every fit are dropped. The process group is created by the first fit
and reused. Printed per precision: median, p25 and p75 step time in ms, the ratio of medians to ``ddp``, and the peak
CUDA memory allocated during the fit.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import sys
import time
import warnings
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch.utils.data import DataLoader

from lightning_zero import ScratchDDPStrategy, ZeroStrategy

try:  # run as a script, sys.path[0] is benchmarks/; imported from the repo root, it is a namespace package
    from benchmarks.gpt import PRESETS, Block, GPTLightningModule, random_token_dataset
    from benchmarks.step_time import QUIET_TRAINER, add_protocol_arguments, quiet_lightning
except ImportError:
    from gpt import PRESETS, Block, GPTLightningModule, random_token_dataset  # type: ignore[no-redef]
    from step_time import QUIET_TRAINER, add_protocol_arguments, quiet_lightning  # type: ignore[no-redef]

CANDIDATES = ("ddp", "ddp_scratch", "zero1_scratch", "zero2_scratch", "zero3_scratch")
MIB = 2**20


def make_strategy(name: str) -> Strategy:
    if name == "ddp":
        return DDPStrategy()
    if name == "ddp_scratch":
        return ScratchDDPStrategy()
    if name == "zero3_scratch":  # one unit per Block, as benchmarks/step_time.py
        return ZeroStrategy(stage=3, auto_wrap_policy={Block})
    if name in ("zero1_scratch", "zero2_scratch"):
        return ZeroStrategy(stage=int(name[4]))
    raise ValueError(f"unknown candidate {name!r}: expected one of {CANDIDATES}")


class CudaStepTimer(L.Callback):
    """Wall time of every optimizer step, with the GPU's queue drained at both ends."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int):
        torch.cuda.synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._start)


def fit_once(name: str, precision: str, args: argparse.Namespace, dataset) -> tuple[list[float], int]:
    """One fit of a freshly initialised model; returns (step times in s, peak CUDA bytes allocated)."""
    L.seed_everything(args.seed, verbose=False)
    module = GPTLightningModule(PRESETS[args.preset])
    timer = CudaStepTimer()
    torch.cuda.reset_peak_memory_stats()
    trainer = L.Trainer(
        accelerator="gpu",
        devices=1,
        strategy=make_strategy(name),
        precision=precision,
        max_steps=args.steps,
        callbacks=[timer],
        **QUIET_TRAINER,
    )
    trainer.fit(module, DataLoader(dataset, batch_size=args.batch_size))
    if trainer.global_step != args.steps:
        raise RuntimeError(f"{name} {precision}: ran {trainer.global_step} optimizer steps, expected {args.steps}")
    peak = torch.cuda.max_memory_allocated()
    del trainer, module
    gc.collect()
    torch.cuda.empty_cache()
    return timer.times, peak


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_protocol_arguments(parser, steps=20, warmup=5, rounds=2, batch_size=16)  # one GPU: one rank, 16 sequences
    parser.add_argument("--precision", nargs="+", default=["32-true", "bf16-mixed"], help="Trainer precisions")
    parser.add_argument("--candidates", nargs="+", choices=CANDIDATES, default=list(CANDIDATES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("gpu_step_time.py needs a CUDA device (benchmarks/step_time.py times CPU ranks)")
    if "LOCAL_WORLD_SIZE" in os.environ:
        sys.exit("run gpu_step_time.py as a plain script (one process, world size 1), not under torchrun")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    quiet_lightning()
    warnings.filterwarnings("ignore", message=r".*communicates the parameters in param_dtype.*")  # ZeRO bf16 gathers
    config = PRESETS[args.preset]
    print(
        f"torch {torch.__version__}, lightning {L.__version__}, {torch.cuda.get_device_name()}, world size 1,"
        f" preset {args.preset} ({config.n_layer}L x {config.n_embd}, vocab {config.vocab_size},"
        f" T={config.block_size}), {args.batch_size} seq/step, AdamW(fused=True), {args.steps} steps per fit"
        f" ({args.warmup} dropped) x {args.rounds} rounds",
        flush=True,
    )
    dataset = random_token_dataset(args.steps * args.batch_size, config.block_size, config.vocab_size, args.seed)
    times: dict[tuple[str, str], list[float]] = {}
    peaks: dict[tuple[str, str], int] = {}
    for round_idx in range(args.rounds):
        for precision in args.precision:
            for name in args.candidates:
                step_times, peak = fit_once(name, precision, args, dataset)
                kept = step_times[args.warmup :]
                times.setdefault((name, precision), []).extend(kept)
                peaks[(name, precision)] = max(peak, peaks.get((name, precision), 0))
                # One line per fit as it ends, so a run stopped by a time limit still leaves figures.
                print(
                    f"round {round_idx + 1} {precision:<10} {name:<14} median {1e3 * statistics.median(kept):8.2f} ms,"
                    f" peak {peak / MIB:9.1f} MiB",
                    flush=True,
                )
    print(f"process group backend: {dist.get_backend() if dist.is_initialized() else 'none'}")
    for precision in args.precision:
        medians = {name: statistics.median(times[(name, precision)]) for name in args.candidates}
        print(f"\nprecision={precision}: step time, ms (synchronised; medians over {args.rounds} rounds)")
        header = f"{'candidate':<16} {'median':>8} {'p25':>8} {'p75':>8} {'n':>4} {'vs ddp':>8} {'peak MiB':>9}"
        print(header)
        print("-" * len(header))
        for name in args.candidates:
            p25, med, p75 = quartiles(times[(name, precision)])
            ratio = f"{med / medians['ddp']:8.3f}" if "ddp" in medians else f"{'n/a':>8}"
            n = len(times[(name, precision)])
            peak = peaks[(name, precision)] / MIB
            print(f"{name:<16} {1e3 * med:8.2f} {1e3 * p25:8.2f} {1e3 * p75:8.2f} {n:>4} {ratio} {peak:9.1f}")
    sys.stdout.flush()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
