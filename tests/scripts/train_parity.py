"""Fit the deterministic parity model under a strategy and save the final parameters.

Launched by ``tests/strategies/test_launchers.py`` as a plain script (Lightning's popen launcher re-executes it for
the extra local ranks) or under ``torchrun``. Global rank 0 writes ``--out``; every other rank ``r`` writes
``--out`` + ``.rank{r}`` so a test can check that the ranks ended with the same weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402

import lightning_zero  # noqa: E402  (registers the strategy names)
from tests.helpers.parity import ParityConfig, ParityModule, fit_lightning, make_trainer, train_loader  # noqa: E402


class _RankRecorder(L.Callback):
    """Remembers the global rank Lightning assigned to this process, and its strategy."""

    global_rank: int | None = None

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.global_rank, self.strategy = trainer.global_rank, trainer.strategy


class _FailOnPurpose(L.Callback):
    """Kills one rank mid-training: the others must exit with an error, not hang."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            raise RuntimeError(f"rank {self.rank} fails on purpose at step {self.step}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--strategy", default="ddp_scratch")
    parser.add_argument("--devices", type=int, default=2, help="processes per node")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--accumulate-grad-batches", type=int, default=1)
    parser.add_argument(
        "--world-size", type=int, default=None, help="ParityConfig.world_size (default: devices * num-nodes)"
    )
    parser.add_argument("--out", type=Path, required=True, help="where global rank 0 saves the final parameters")
    parser.add_argument("--fail-rank", type=int, default=None, help="this global rank raises at --fail-step")
    parser.add_argument("--fail-step", type=int, default=2)
    parser.add_argument(
        "--check-children",
        action="store_true",
        help="rank 0 of the popen launcher waits for the ranks it started and exits 3 if one did not exit 0",
    )
    return parser.parse_args(argv)


def _wait_for_children(trainer_strategy: object) -> None:
    launcher = getattr(trainer_strategy, "launcher", None)
    codes = [proc.wait(timeout=120) for proc in getattr(launcher, "procs", [])]
    if any(code != 0 for code in codes):
        print(f"child ranks exited with {codes}", flush=True)
        sys.exit(3)


def _fit_spawn(config: ParityConfig, strategy: object, devices: int) -> dict[str, torch.Tensor]:
    L.seed_everything(config.seed, verbose=False)
    module = ParityModule(config.lr)
    trainer = make_trainer(config, strategy, devices=devices)
    trainer.fit(module, train_loader(config))
    assert trainer.state.finished, trainer.state
    return {k: v.detach().clone() for k, v in module.net.state_dict().items()}


def _strategy(name: str) -> str | lightning_zero.PipelineStrategy:
    """The registered name, except for the pipeline: the parity module's layers are its ``net``."""
    if name.startswith("pipeline_scratch"):
        start_method = "spawn" if name.endswith("_spawn") else "popen"
        return lightning_zero.PipelineStrategy(layers="net", start_method=start_method)
    return name


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    world_size = args.world_size if args.world_size is not None else args.devices * args.num_nodes
    config = ParityConfig(world_size=world_size, accumulate_grad_batches=args.accumulate_grad_batches)
    recorder = _RankRecorder()
    callbacks: list[L.Callback] = [recorder]
    if args.fail_rank is not None:
        callbacks.append(_FailOnPurpose(args.fail_rank, args.fail_step))
    if args.strategy.endswith("_spawn"):  # this process is the launcher: it gets rank 0's weights back
        params, rank = _fit_spawn(config, _strategy(args.strategy), args.devices), 0
    else:
        params = fit_lightning(
            config, _strategy(args.strategy), devices=args.devices, num_nodes=args.num_nodes, callbacks=callbacks
        )
        rank = recorder.global_rank
    assert rank is not None, "on_fit_end never ran"
    out = args.out if rank == 0 else args.out.with_name(f"{args.out.name}.rank{rank}")
    torch.save(params, out)
    # The process group stays alive: the strategy tears it down at exit (lightning_zero/strategies/base.py).
    if args.check_children and rank == 0 and not args.strategy.endswith("_spawn"):  # spawn: the launcher checks
        _wait_for_children(recorder.strategy)


if __name__ == "__main__":
    main()
