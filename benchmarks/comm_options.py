"""The communication options (README "Communication options") on the demo: final loss, ledger bytes against the
theory, step time, each option against its strategy's uncompressed run.

Runbook (the script starts its own processes, one set for all fits; no torchrun)::

    python benchmarks/comm_options.py                      # the CLI's demo, 300 steps, every option
    python benchmarks/comm_options.py --n-embd 64          # a narrower demo: the README's tables
    python benchmarks/comm_options.py --steps 20 --timing-rounds 1 --timing-steps 8 --warmup 3   # smoke run
    python benchmarks/comm_options.py --quant-block-size 2048 --options zero3 zero3_qwZ

Options (:data:`OPTIONS`): under ``zero3_scratch`` the exact run (``zero3``) and ZeRO++'s ``qwZ``, ``qgZ`` and both;
under ``ddp_scratch`` the exact run (``ddp``), gradients averaged in bf16 (``ddp_bf16comm``) and PowerSGD at rank 4
after 10 plain steps (``ddp_powersgd``). Each option is compared with the exact run of its strategy.

Workload: the demo of ``lightning-zero-train`` (``conf/model/char_gpt.yaml``, ``conf/data/pydoc_chars.yaml``,
``conf/optimizer/adamw.yaml``): :class:`lightning_zero.demo.CharGPTModule` (3 blocks x 96, 4 heads, context 64; its
blocks are the ZeRO-3 units, embeddings and head the root unit) on the stdlib's ``pydoc_data.topics`` text, 32
sequences per rank, AdamW(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1) with 20 warm-up steps and cosine decay,
gradient clipping at 1.0, fp32, on ``--ranks`` CPU processes (gloo, one thread each). Every option fits the same model
from the same seed on the same batches for ``--steps`` optimizer steps, one option after the other in one launch (the
process group is created by the first fit and reused); then ``--timing-rounds`` rounds of ``--timing-steps``-step
fits, the options interleaved (A B C D A B C D ...), time the steps.

Reported per option:

- loss: the training loss over the last ``--last`` steps (mean over steps and ranks), and the validation loss of the
  final weights (the fp32 masters the fit hands back into the module, whatever was quantized on the way) over the
  whole validation split, computed on rank 0 without any strategy; the difference to its exact run's.
- bytes per step: :data:`lightning_zero.comm.collectives.LEDGER` over each training batch, all-gather output (tag
  ``"params"``) and gradient reduction input (tags ``"grads"``, ``"grads_powersgd_*"``), against the theory of each
  step: ``engine.step_nbytes()`` under ZeRO-3 ([Note: stage-3 traffic] in ``lightning_zero/zero/stage3/traffic.py``),
  :func:`ddp_theory` under ``ddp_scratch``; the table shows the last step's bytes, the worst step's ratio is printed,
  and a step more than 1% off fails the run.
- step time: in the interleaved timing fits only, so that a machine whose load changes during the launch (the long
  fits take minutes each) slows every option alike: each optimizer step timed from ``on_train_batch_start`` to
  ``on_train_batch_end``, the slowest rank's time per step, the first ``--warmup`` steps of every fit dropped; the
  median over all rounds, its ratio to its exact run's, and the median of each round. Compare within one run:
  absolute times move by ~20% between runs on a 2-core machine.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn import functional as F

from lightning_zero import ScratchDDPStrategy, ZeroStrategy
from lightning_zero.comm.collectives import LEDGER
from lightning_zero.comm.powersgd import compressed_step_bytes
from lightning_zero.comm.powersgd_config import PowerSGDConfig
from lightning_zero.demo import CharGPTModule, CharTextDataModule
from lightning_zero.zero.settings import QUANT_BLOCK_SIZE

try:  # run as a script, sys.path[0] is benchmarks/; imported from the repo root, it is a namespace package
    from benchmarks import processes
    from benchmarks.step_time import QUIET_TRAINER, StepTimer, quiet_lightning
except ImportError:
    import processes  # type: ignore[no-redef]
    from step_time import QUIET_TRAINER, StepTimer, quiet_lightning  # type: ignore[no-redef]

POWERSGD = {"rank": 4, "start_iter": 10}
OPTIONS = {
    "zero3": ("zero3", {}),
    "zero3_qwZ": ("zero3", {"quantized_weights": True}),
    "zero3_qgZ": ("zero3", {"quantized_grads": True}),
    "zero3_qwZ+qgZ": ("zero3", {"quantized_weights": True, "quantized_grads": True}),
    "ddp": ("ddp", {}),
    "ddp_bf16comm": ("ddp", {"reduce_dtype": "bf16"}),
    "ddp_powersgd": ("ddp", {"grad_compression": "powersgd", "powersgd": POWERSGD}),
}
"""Each option's baseline (the exact run of its strategy, which is also an option) and strategy settings."""
MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per fit")
    parser.add_argument("--timing-rounds", type=int, default=3, help="interleaved rounds of timing fits")
    parser.add_argument("--timing-steps", type=int, default=30, help="optimizer steps per timing fit")
    parser.add_argument("--warmup", type=int, default=5, help="steps of every timing fit left out of the median")
    parser.add_argument("--last", type=int, default=20, help="final steps the training loss is averaged over")
    parser.add_argument("--ranks", type=int, default=None, help="CPU processes (2; under torchrun its world)")
    parser.add_argument("--quant-block-size", type=int, default=QUANT_BLOCK_SIZE, help="elements per int8 block")
    parser.add_argument("--options", nargs="+", choices=list(OPTIONS), default=list(OPTIONS), help="fitted in order")
    parser.add_argument("--n-layer", type=int, default=3, help="the demo's blocks")
    parser.add_argument("--n-embd", type=int, default=96, help="the demo's width")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per rank per step")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    args.ranks = processes.launched_world(2) if args.ranks is None else args.ranks
    if args.steps < args.last or args.timing_steps <= args.warmup:
        parser.error("--steps must be >= --last and --timing-steps must exceed --warmup")
    if min(args.ranks, args.quant_block_size, args.timing_rounds, args.last) < 1:
        parser.error("--ranks, --quant-block-size, --timing-rounds and --last must be >= 1")
    missing = sorted({OPTIONS[name][0] for name in args.options} - set(args.options))
    if missing:
        parser.error(f"--options must include {missing}: the ratios are against each option's exact run")
    return args


def ddp_theory(settings: dict[str, Any], module: torch.nn.Module, step: int) -> dict[str, int]:
    """Gradient bytes of optimizer step ``step`` under ``ddp_scratch`` with ``settings``: 4Ψ (fp32), 2Ψ (bf16), or
    PowerSGD's compressed bytes from ``start_iter`` on ([Note: PowerSGD, one bucket])."""
    params = [p for p in module.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    if settings.get("grad_compression") == "powersgd":
        config = PowerSGDConfig.from_options(settings["powersgd"])
        if step >= config.start_iter:
            return {"params": 0, "grads": compressed_step_bytes([tuple(p.shape) for p in params], config)}
    return {"params": 0, "grads": numel * (2 if settings.get("reduce_dtype") == "bf16" else 4)}


class Probe(StepTimer):
    """Step times (:class:`StepTimer`), each batch's ledger bytes by tag and its theory, and the training losses."""

    def __init__(self, settings: dict[str, Any]) -> None:
        super().__init__()
        self.settings = settings
        self.params: list[int] = []
        self.grads: list[int] = []
        self.losses: list[float] = []
        self.theory: list[dict[str, int]] = []  # per step
        self.psi = 0

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        LEDGER.reset()
        engine = getattr(trainer.strategy, "engine", None)
        if hasattr(engine, "step_nbytes"):  # ZeRO-3
            self.theory.append(engine.step_nbytes())
        else:
            self.theory.append(ddp_theory(self.settings, pl_module, trainer.global_step))
        self.psi = sum(p.numel() for p in pl_module.parameters())
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.params.append(LEDGER.bytes("all_gather", "params"))
        # "grads" (all-reduce or reduce-scatter), and PowerSGD's "grads_powersgd_p"/"_q"/"_uncompressed"
        self.grads.append(sum(b for (op, tag), (_, b) in LEDGER.summary().items() if tag.startswith("grads")))
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


@torch.no_grad()
def validation_loss(module: CharGPTModule, data: CharTextDataModule, batch_size: int = 64) -> float:
    """Mean next-character cross entropy of the module's (full) weights over the whole validation split."""
    assert module.net is not None and data.val_set is not None
    module.net.eval()
    total, count = 0.0, 0
    for x, y in torch.utils.data.DataLoader(data.val_set, batch_size=batch_size):
        total += F.cross_entropy(module.net(x).flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    return total / count


def fit_once(name: str, args: argparse.Namespace, steps: int, evaluate: bool = True) -> dict[str, Any]:
    """One fit of the demo under option ``name`` for ``steps`` optimizer steps; plain numbers only (nothing of the fit
    outlives it)."""
    L.seed_everything(args.seed, verbose=False)  # same init, same batches for every option
    data = CharTextDataModule(block_size=64, batch_size=args.batch_size)
    optimizer = functools.partial(torch.optim.AdamW, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    module = CharGPTModule(
        data.vocab_size, block_size=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd, optimizer=optimizer
    )
    family, settings = OPTIONS[name]
    probe = Probe(settings)
    if family == "zero3":
        strategy = ZeroStrategy(stage=3, quant_block_size=args.quant_block_size, **settings)
    else:
        strategy = ScratchDDPStrategy(**settings)
    devices, num_nodes = processes.trainer_layout(args.ranks)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        max_steps=steps,
        gradient_clip_val=1.0,
        limit_val_batches=0,
        callbacks=[probe],
        **QUIET_TRAINER,
    )
    trainer.fit(module, datamodule=data)
    if trainer.global_step != steps:
        raise RuntimeError(f"{name}: ran {trainer.global_step} optimizer steps, expected {steps}")
    evaluate = evaluate and trainer.global_rank == 0
    val = validation_loss(module, data) if evaluate else float("nan")  # the masters, handed back
    fields = ("times", "params", "grads", "losses", "theory", "psi")
    return {"val_loss": val, **{field: getattr(probe, field) for field in fields}}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, results: mp.Queue) -> None:
    processes.torchelastic_env(rank, world, port)
    torch.set_num_threads(1)  # ranks share the cores: one thread each, or they fight for them
    quiet_lightning()
    runs = {name: fit_once(name, args, args.steps) for name in args.options}
    for name in args.options:
        runs[name]["timed"] = []  # one list of step times per round
    for _ in range(args.timing_rounds):
        for name in args.options:  # interleaved
            runs[name]["timed"].append(fit_once(name, args, args.timing_steps, evaluate=False)["times"][args.warmup :])
    gathered: list[dict[str, Any]] = [{} for _ in range(world)]
    dist.all_gather_object(gathered, runs)
    if rank == 0:
        results.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every option's runs, one dict per rank (fits in fresh processes)."""
    return processes.run_ranks(_worker, args.ranks, args)


def report(args: argparse.Namespace, gathered: list[dict[str, Any]]) -> bool:
    """Print the table; ``False`` if a step's ledger bytes are more than 1% off the theory."""
    rows, medians, rounds, ok = [], {}, {}, True
    for name in args.options:
        ranks = [g[name] for g in gathered]
        run = ranks[0]
        # per round, the slowest rank's time of each step
        per_round = [[max(ts) for ts in zip(*steps, strict=True)] for steps in zip(*(r["timed"] for r in ranks))]
        medians[name] = statistics.median(t for times in per_round for t in times)
        rounds[name] = [statistics.median(times) for times in per_round]
        train = statistics.mean(loss for r in ranks for loss in r["losses"][-args.last :])
        # the ledger of every step against the theory (every rank communicates the same bytes)
        worst = {}
        for tag in ("params", "grads"):
            pairs = [(b, t[tag]) for r in ranks for b, t in zip(r[tag], r["theory"], strict=True)]
            worst[tag] = max((abs(b / t - 1) if t else float(b != 0) for b, t in pairs), default=0.0)
            ok &= worst[tag] <= 0.01
        rows.append((name, train, run["val_loss"], run, worst))
    vals = {row[0]: row[2] for row in rows}
    psi = rows[0][3]["psi"]
    print(
        f"\nΨ = {psi:,} parameters, N = {args.ranks}, quant_block_size = {args.quant_block_size}; losses and bytes:"
        f" {args.steps} steps; step time: median of {args.timing_rounds} interleaved rounds x"
        f" {args.timing_steps - args.warmup} steps (slowest rank; {args.warmup} warm-up steps dropped per fit)"
    )
    header = [
        "option",
        f"train loss (last {args.last})",
        "val loss",
        "Δ val vs its exact run",
        "params MiB/step ledger (theory)",
        "grads MiB/step ledger (theory)",
        "ledger/theory worst",
        "median step ms",
        "vs its exact run",
        "per-round medians ms",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|")
    for name, train, val, run, worst in rows:
        base = OPTIONS[name][0]
        # the last step's bytes (PowerSGD's first steps are plain)
        per_step = {tag: run[tag][-1] / MIB for tag in ("params", "grads")}
        theory = {tag: run["theory"][-1][tag] / MIB for tag in ("params", "grads")}
        cells = [
            name,
            f"{train:.4f}",
            f"{val:.4f}",
            f"{val - vals[base]:+.4f}",
            f"{per_step['params']:.3f} ({theory['params']:.3f})",
            f"{per_step['grads']:.3f} ({theory['grads']:.3f})",
            f"{1 + max(worst.values()):.4f}",
            f"{1e3 * medians[name]:.1f}",
            f"{medians[name] / medians[base]:.3f}",
            " / ".join(f"{1e3 * r:.1f}" for r in rounds[name]),
        ]
        print("| " + " | ".join(cells) + " |")
    theories = {row[0]: row[3]["theory"][-1] for row in rows}
    for name in theories:
        base = theories[OPTIONS[name][0]]
        if name != OPTIONS[name][0]:
            fractions = ", ".join(
                f"{tag} {theories[name][tag] / base[tag]:.3f}" for tag in ("params", "grads") if base[tag]
            )
            print(f"{name}: bytes of the last step / its exact run's: {fractions}")
    return ok


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if processes.reports():  # under torchrun the other ranks stay quiet
        _print_header(args)
    start = time.perf_counter()
    gathered = measure(args)
    ok = report(args, gathered)
    print(f"wall time {time.perf_counter() - start:.0f} s")
    if not ok:
        sys.exit("a step's ledger bytes are more than 1% off the theory")


def _print_header(args: argparse.Namespace) -> None:
    print(
        f"reproduce: {processes.launch_prefix()} benchmarks/comm_options.py --steps {args.steps}"
        f" --timing-rounds {args.timing_rounds} --timing-steps {args.timing_steps} --warmup {args.warmup}"
        f" --last {args.last} --ranks {args.ranks}"
        f" --quant-block-size {args.quant_block_size} --n-layer {args.n_layer}"
        f" --n-embd {args.n_embd} --batch-size {args.batch_size} --seed {args.seed} --options {' '.join(args.options)}"
    )
    print(f"torch {torch.__version__}, lightning {L.__version__}, {os.cpu_count()} CPUs, gloo, 1 thread per rank")


if __name__ == "__main__":
    main()
