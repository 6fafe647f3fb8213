"""Fit the parity model with checkpoints, and hurt it on purpose: SIGKILL one rank, or signal one rank or all.

Launched by ``tests/strategies/test_faults.py`` under ``torchrun`` (``--max-restarts``) or as a plain script
(Lightning's popen launcher re-executes it for the extra local ranks). Every launch passes ``ckpt_path="last"`` to
``fit``: the first one finds nothing and starts from scratch, a restarted one resumes from the newest ``last*.ckpt``
in ``--ckpt-dir`` (``ModelCheckpoint(save_last=True)`` after every step, or ``PreemptionCheckpoint``'s file).
Global rank 0 saves the final parameters to ``--out`` when the fit completes.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

import lightning_zero  # noqa: E402
from tests.helpers.parity import ParityConfig, ParityModule, make_dataset, make_trainer  # noqa: E402


class _Hurt(L.Callback):
    """At the start of ``step`` on ``rank`` (``-1``: every rank), on the first launch only, send ``signum`` to this
    process: SIGKILL dies on the spot, SIGTERM/SIGUSR1 are what a cluster sends before it preempts a job."""

    def __init__(self, signum: int, rank: int, step: int) -> None:
        self.signum, self.rank, self.step = signum, rank, step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx) -> None:
        first_launch = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_launch and trainer.global_step == self.step and self.rank in (-1, trainer.global_rank):
            os.kill(os.getpid(), self.signum)


def _kill_in_save(n: int) -> None:
    """Every rank SIGKILLs itself in its ``n``-th sharded save, once its shards are written and before anything is
    renamed: a job killed while it saves."""
    real_save, calls = dcp.save, [0]

    def save(*args, **kwargs):
        result = real_save(*args, **kwargs)
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    dcp.save = save


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--strategy", default="ddp_scratch")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hurt", default=None, help="SIGKILL, SIGTERM or SIGUSR1, sent to --hurt-rank at --hurt-step")
    parser.add_argument("--hurt-rank", type=int, default=1, help="-1: every rank")
    parser.add_argument("--hurt-step", type=int, default=5)
    parser.add_argument("--every-step", action="store_true", help="ModelCheckpoint after every optimizer step")
    parser.add_argument("--kill-in-save", type=int, default=None, help="SIGKILL every rank in its N-th DCP save")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    config = ParityConfig(world_size=args.devices)
    callbacks: list[L.Callback] = [
        ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True, every_n_train_steps=1 if args.every_step else None),
        lightning_zero.PreemptionCheckpoint(),
    ]
    if args.kill_in_save is not None:
        _kill_in_save(args.kill_in_save)
    if args.hurt:
        callbacks.append(_Hurt(signal.Signals[args.hurt], args.hurt_rank, args.hurt_step))
    L.seed_everything(config.seed, verbose=False)
    module = ParityModule(config.lr, config.optimizer)
    trainer = make_trainer(config, args.strategy, devices=args.devices, callbacks=callbacks, enable_checkpointing=True)
    # A loader that resumes its position: Lightning then resumes a mid-epoch checkpoint exactly.
    loader = StatefulDataLoader(make_dataset(config), batch_size=config.batch_size, shuffle=False)
    trainer.fit(module, loader, ckpt_path="last")
    if not args.strategy.endswith("_spawn"):  # the spawn launcher's main process only gets rank 0's weights back
        assert trainer.global_step == config.optimizer_steps, (trainer.global_step, config.optimizer_steps)
    engine = getattr(trainer.strategy, "engine", None)
    gather = getattr(engine, "summon_full_params", None)
    if gather is not None:  # ZeRO-3 keeps the module sharded after fit
        with gather():
            params = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
    else:
        params = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
    if trainer.global_rank == 0:
        torch.save(params, args.out)


if __name__ == "__main__":
    main()
