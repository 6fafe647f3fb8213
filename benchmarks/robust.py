"""Robust aggregation at scale: step time and per-rank memory of ``robust_ddp_scratch`` with the workers' vectors
all-gathered (unsharded) or exchanged by column shard (``sharded_aggregation=True``), of ``robust_zero2_scratch`` and of
replicated aggregation, against ``ddp_scratch``, on the GPT benchmark model.

Runbook (2 CPU ranks, gloo, one thread each; n = 2 ranks x 4 workers = 8 workers)::

    torchrun --nproc_per_node 2 benchmarks/robust.py          # gpt25m, mean/median/trimmed_mean/krum, ~15 min
    torchrun --nproc_per_node 2 benchmarks/robust.py --preset tiny --steps 4 --warmup 1 --rounds 1   # smoke run

Protocol: ``benchmarks/step_time.py``'s: every round fits the same model (same seed, init and data,
``AdamW(fused=True)``, fp32) under every candidate in turn, each optimizer step is timed on every rank, a step's time
is the slowest rank's, the first ``--warmup`` steps of every fit are dropped, and only ratios within one run count.
Each rank's ``--batch-size`` sequences are split into ``--workers-per-rank`` chunks, one forward and backward each;
``ddp_scratch`` runs the same batch in one forward and backward.

Candidates (``--candidates``): ``ddp_scratch``; ``RULE`` (unsharded: every rank all-gathers the ``(n, d)`` stack and
aggregates all of it), ``RULE_sharded`` (each rank receives and aggregates ``n x d / N`` values, then the aggregate is
all-gathered), ``RULE_replicated`` (sharded, ``aggregation_replicas=2``: every shard aggregated twice and the digests
compared), ``RULE_zero2`` (``robust_zero2_scratch``: the aggregated shard is the optimizer shard's gradient) and
``RULE_byzantine`` (``byzantine_ranks=1``, at least 4 processes: signed messages, each shard on 3 ranks, agreement on
every step), for ``RULE`` in median, trimmed_mean, krum and mean (``f = --f``; the Byzantine mode refuses mean).

Memory: at the last step's ``on_before_optimizer_step``, the strategy's model-state bytes (parameters, gradients,
optimizer state, strategy buffers), and of the robust buffers apart: this rank's worker rows (``k x d``) and the rows it
received (``n x d`` unsharded, ``n x d / N`` sharded), in units of ``d`` fp32 values.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_zero import RobustDDPStrategy, RobustZeroStrategy, ScratchDDPStrategy
from lightning_zero.training.memory import ModelStateBytes

try:  # run as a script, sys.path[0] is benchmarks/; imported from the repo root, it is a namespace package
    from benchmarks.gpt import GPT, PRESETS, GPTLightningModule, random_token_dataset
    from benchmarks.processes import launch_prefix
    from benchmarks.step_time import QUIET_TRAINER, StepTimer, add_protocol_arguments, quartiles, quiet_lightning
except ImportError:
    from gpt import GPT, PRESETS, GPTLightningModule, random_token_dataset  # type: ignore[no-redef]
    from processes import launch_prefix  # type: ignore[no-redef]
    from step_time import (  # type: ignore[no-redef]
        QUIET_TRAINER,
        StepTimer,
        add_protocol_arguments,
        quartiles,
        quiet_lightning,
    )

RULES = ("mean", "median", "trimmed_mean", "krum")
MODES = ("", "_sharded", "_replicated", "_zero2", "_byzantine")
CANDIDATES = ("ddp_scratch", *(rule + mode for rule in RULES for mode in MODES))
DEFAULT_CANDIDATES = ("ddp_scratch", *(rule + mode for rule in RULES for mode in ("", "_sharded")))
MIB = 2**20


def make_strategy(name: str, args: argparse.Namespace) -> Any:
    if name == "ddp_scratch":
        return ScratchDDPStrategy()
    mode = next((m for m in MODES if m and name.endswith(m)), "")
    rule = name[: len(name) - len(mode)]
    robust = dict(aggregator=rule, f=0 if rule == "mean" else args.f, workers_per_rank=args.workers_per_rank)
    if mode == "_zero2":
        return RobustZeroStrategy(stage=2, **robust)
    if mode == "_replicated":
        return RobustDDPStrategy(sharded_aggregation=True, aggregation_replicas=2, **robust)
    if mode == "_byzantine":  # needs >= 4 processes: byzantine_ranks=1
        return RobustDDPStrategy(byzantine_ranks=1, byzantine_timeout=120.0, **robust)
    return RobustDDPStrategy(sharded_aggregation=mode == "_sharded", **robust)


class MemoryProbe(L.Callback):
    """Model-state bytes, the robust rows and the aggregation time at every optimizer step (the last one kept)."""

    def __init__(self) -> None:
        self.memory: ModelStateBytes | None = None
        self.rows = self.received = 0
        self.aggregation_ms: list[float] = []
        self.phases_ms: dict[str, list[float]] = {}  # the Byzantine ranks mode's phases, by step

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        strategy = trainer.strategy
        self.memory = strategy.model_state_bytes()
        engine = getattr(strategy, "robust_engine", None)
        if engine is not None:
            self.rows = sum(t.numel() * t.element_size() for t in engine.grads.buffers)
            self.received = sum(t.numel() * t.element_size() for t in engine.received)
            self.aggregation_ms.append(engine.last_metrics["robust/aggregation_ms"])
            outcome = getattr(engine.exchange, "last_outcome", None)
            for phase, seconds in (outcome.seconds if outcome is not None else {}).items():
                self.phases_ms.setdefault(phase, []).append(seconds * 1e3)


def fit_once(name: str, args: argparse.Namespace, dataset: Any, world: int) -> tuple[list[float], MemoryProbe]:
    L.seed_everything(args.seed, verbose=False)
    module = GPTLightningModule(PRESETS[args.preset])
    timer, probe = StepTimer(), MemoryProbe()
    local = int(os.environ["LOCAL_WORLD_SIZE"])  # torchrun's ranks per node (lightning-zero-netlab: several nodes)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=local,
        num_nodes=world // local,
        strategy=make_strategy(name, args),
        max_steps=args.steps,
        callbacks=[timer, probe],
        **QUIET_TRAINER,
    )
    trainer.fit(module, DataLoader(dataset, batch_size=args.batch_size))
    del trainer, module
    gc.collect()
    probe_out = MemoryProbe()  # keep the numbers, not the callback (it holds the module through Lightning's binding)
    probe_out.memory, probe_out.rows, probe_out.received = probe.memory, probe.rows, probe.received
    probe_out.aggregation_ms = probe.aggregation_ms[args.warmup :]
    probe_out.phases_ms = {phase: ms[args.warmup :] for phase, ms in probe.phases_ms.items()}
    return timer.times, probe_out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_protocol_arguments(parser, steps=10, warmup=3, rounds=3, batch_size=4)
    parser.add_argument("--workers-per-rank", type=int, default=4, help="k: virtual workers per rank")
    parser.add_argument("--f", type=int, default=2, help="Byzantine workers tolerated by the robust rules")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--candidates", nargs="+", choices=CANDIDATES, default=list(DEFAULT_CANDIDATES))
    args = parser.parse_args(argv)
    if args.steps <= args.warmup or args.batch_size % args.workers_per_rank:
        parser.error("--steps must exceed --warmup, and --workers-per-rank divide --batch-size")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "LOCAL_WORLD_SIZE" not in os.environ:
        sys.exit("launch with torchrun, e.g.: torchrun --nproc_per_node 2 benchmarks/robust.py")
    torch.set_num_threads(1)
    quiet_lightning()
    world = int(os.environ["WORLD_SIZE"])
    config = PRESETS[args.preset]
    dataset = random_token_dataset(args.steps * args.batch_size * world, config.block_size, config.vocab_size, 0)
    times: dict[str, list[float]] = {name: [] for name in args.candidates}
    probes: dict[str, MemoryProbe] = {}
    for _ in range(args.rounds):
        for name in args.candidates:
            fit_times, probe = fit_once(name, args, dataset, world)
            times[name].extend(fit_times[args.warmup :])
            probes[name] = probe
    gathered: list[dict[str, list[float]]] = [{} for _ in range(world)]
    dist.all_gather_object(gathered, times)
    if dist.get_rank() == 0:
        report(args, config, gathered, probes, world)
    dist.barrier()
    dist.destroy_process_group()


def report(args: argparse.Namespace, config: Any, gathered: list, probes: dict[str, MemoryProbe], world: int) -> None:
    psi = GPT(config).num_parameters()
    n = args.workers_per_rank * world
    print(
        f"reproduce: {launch_prefix(int(os.environ['LOCAL_WORLD_SIZE']))} benchmarks/robust.py --preset {args.preset}"
        f" --steps {args.steps}"
        f" --warmup {args.warmup} --rounds {args.rounds} --batch-size {args.batch_size} --workers-per-rank"
        f" {args.workers_per_rank} --f {args.f} --candidates {' '.join(args.candidates)}"
    )
    print(
        f"torch {torch.__version__}, {world} ranks x 1 thread, preset {args.preset} (d = Ψ = {psi:,}), n = {n} workers"
        f" ({args.workers_per_rank} per rank, {args.batch_size // args.workers_per_rank} sequences each), f = {args.f}"
    )
    medians = {}
    print(f"\n{'candidate':<22} {'median ms':>9} {'p25':>8} {'p75':>8} {'vs ddp_scratch':>14} {'agg ms':>7}"
          f" {'rows/d':>6} {'received/d':>10} {'total MiB':>9}  per-round medians")  # fmt: skip
    kept = args.steps - args.warmup
    for name in args.candidates:
        per_step = [max(ts) for ts in zip(*(g[name] for g in gathered), strict=True)]
        rounds = [statistics.median(per_step[i : i + kept]) for i in range(0, len(per_step), kept)]
        p25, med, p75 = quartiles(per_step)
        medians[name] = med
        ratio = med / medians["ddp_scratch"] if "ddp_scratch" in medians else float("nan")
        probe = probes[name]
        agg = statistics.median(probe.aggregation_ms) if probe.aggregation_ms else 0.0
        total = probe.memory.total / MIB if probe.memory is not None else float("nan")
        print(
            f"{name:<22} {1e3 * med:9.1f} {1e3 * p25:8.1f} {1e3 * p75:8.1f} {ratio:14.3f} {agg:7.1f}"
            f" {probe.rows / (4 * psi):6.2f} {probe.received / (4 * psi):10.2f} {total:9.1f}  "
            + " / ".join(f"{1e3 * r:.1f}" for r in rounds)
        )
    for name in args.candidates:
        if probes[name].phases_ms:
            phases = ", ".join(f"{p} {statistics.median(ms):.1f}" for p, ms in probes[name].phases_ms.items())
            print(f"\n{name}: median ms by phase on rank 0: {phases}")
    print("\nmodel states per rank at the last step, MiB (params / grads / optimizer / strategy buffers):")
    for name in args.candidates:
        m = probes[name].memory
        if m is not None:
            print(f"  {name:<22} {m.params / MIB:8.2f} {m.grads / MIB:8.2f} {m.optimizer / MIB:8.2f}"
                  f" {m.strategy_buffers / MIB:8.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
