"""Save and exit on preemption: ``SIGTERM`` / ``SIGUSR1`` write a checkpoint collectively at the next optimizer
step, then every rank exits with status 0, ready to be resumed.

Clusters announce the end of a job with a signal: SLURM sends ``SIGUSR1`` (with ``--signal=USR1@90``) or ``SIGTERM``
before killing it, torchrun's agent forwards ``SIGTERM`` to its workers, Kubernetes sends ``SIGTERM``. Lightning's
own handling does not fit sharded training: on ``SIGTERM`` it exits without saving, and its ``SIGUSR1`` handler
(``SLURMEnvironment(auto_requeue=True)``) calls ``trainer.save_checkpoint`` *inside the signal handler*, that is at
whatever point the signal interrupts, possibly in the middle of a collective, which with sharded states is a save
that deadlocks or mixes two steps. :class:`PreemptionCheckpoint` (any strategy, ours or Lightning's)::

    trainer = L.Trainer(strategy="zero3_scratch", callbacks=[ModelCheckpoint(dirpath="ckpt", save_last=True),
                                                             PreemptionCheckpoint()])
    trainer.fit(model, ckpt_path="last")   # the next launch resumes from the newest of last*.ckpt

1. From ``on_train_start`` the signals only set a flag (they replace Lightning's handlers for the rest of the fit;
   Lightning restores the original handlers when the fit ends).
2. After every optimizer step (never inside an accumulation window) the ranks agree on the flag: one boolean
   reduction, so a signal that reached a single rank (``kill -TERM`` of the launching process) stops them all at the
   same step.
3. Then every rank calls ``trainer.save_checkpoint`` (collective for sharded strategies) into ``<dirpath>/<filename>``
   (``last-preempted.ckpt`` next to the ``ModelCheckpoint``'s files, so ``fit(ckpt_path="last")`` finds it by its
   name and time); under SLURM into ``hpc_ckpt_<n>.ckpt`` in ``default_root_dir``, which Lightning resumes by itself,
   and rank 0 requeues the job when ``SLURMEnvironment(auto_requeue=True)``.
4. Each rank raises :class:`Preempted` (a ``SystemExit`` with status 0): the fit ends as Lightning ends it on
   ``SIGTERM``, without running the epoch-end hooks that would write a misleading "end of epoch" checkpoint.

The save is a mid-epoch checkpoint: Lightning resumes it exactly when the training loader can resume its position
(``state_dict``/``load_state_dict``, e.g. torchdata's ``StatefulDataLoader``); with a plain ``DataLoader`` it
restarts the epoch's batches, with a warning, as it does for any mid-epoch checkpoint.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from typing_extensions import override

log = logging.getLogger(__name__)

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


class Preempted(SystemExit):
    """Raised on every rank once the preemption checkpoint is written: the process exits with status 0."""

    def __init__(self, signal_name: str, path: str) -> None:
        super().__init__(0)
        self.signal_name, self.path = signal_name, path

    def __reduce__(self) -> tuple[Any, ...]:  # a spawn worker hands it to the main process through a queue
        return (Preempted, (self.signal_name, self.path))

    def __str__(self) -> str:
        return f"{self.signal_name} received: checkpoint saved to {self.path}; resume with ckpt_path={self.path!r}"


def _signal(name: str) -> signal.Signals:
    valid = sorted(s.name for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP))
    if name not in valid:
        raise ValueError(f"signals: {name!r} is invalid: expected signal names such as SIGTERM, SIGUSR1 ({valid})")
    return signal.Signals[name]


class PreemptionCheckpoint(Callback):
    """Write a checkpoint at the next optimizer step after one of ``signals`` reaches any rank, then exit (status 0).

    Args:
        dirpath: where to save; ``None``: the first ``ModelCheckpoint``'s ``dirpath``, else ``default_root_dir``.
        filename: the checkpoint's name without ``.ckpt``; keep it starting with ``last`` so that
            ``fit(ckpt_path="last")`` finds it.
        signals: the signal names to handle (not ``SIGKILL``/``SIGSTOP``, which cannot be caught).
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str = "last-preempted",
        signals: Sequence[str] = DEFAULT_SIGNALS,
    ) -> None:
        if isinstance(signals, str) or not signals:
            raise ValueError(f"signals={signals!r} is invalid: expected a non-empty list of names such as ['SIGTERM']")
        if not filename or "/" in filename:
            raise ValueError(f"filename={filename!r} is invalid: expected a file name without a directory")
        self.signals = [_signal(name) for name in signals]
        self.dirpath, self.filename = dirpath, filename
        self.received: signal.Signals | None = None
        self.ckpt_path: str | None = None  # where the last preemption checkpoint went
        self._previous: dict[signal.Signals, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        # Only a flag: the handler may run in the middle of a collective, where saving would deadlock.
        if self.received is None:
            self.received = signal.Signals(signum)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.received = None
        if threading.current_thread() is not threading.main_thread():
            log.warning("PreemptionCheckpoint: not in the main thread, so no signal handler is installed")
            return
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        epoch_loop = trainer.fit_loop.epoch_loop
        if epoch_loop._should_accumulate():  # mid-window: the accumulated gradients are in no checkpoint
            return
        if not trainer.strategy.reduce_boolean_decision(self.received is not None, all=False):
            return
        name = self.received.name if self.received is not None else "a signal to another rank"
        path = trainer.strategy.broadcast(self._path(trainer))  # rank 0 numbers hpc_ckpt_<n> for everyone
        log.warning("rank %d: %s: saving %s at step %d", trainer.global_rank, name, path, trainer.global_step)
        trainer.save_checkpoint(path)
        self.ckpt_path = path
        if trainer.is_global_zero:
            self._requeue(trainer)
        raise Preempted(name, path)

    def _path(self, trainer: pl.Trainer) -> str:
        if self._slurm(trainer) is not None and self.dirpath is None:
            return trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        dirpath = self.dirpath
        if dirpath is None:
            dirpath = next(
                (c.dirpath for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath),
                trainer.default_root_dir,
            )
        return os.path.join(dirpath, self.filename + ModelCheckpoint.FILE_EXTENSION)

    @staticmethod
    def _slurm(trainer: pl.Trainer) -> SLURMEnvironment | None:
        environment = trainer._accelerator_connector.cluster_environment
        return environment if isinstance(environment, SLURMEnvironment) else None

    def _requeue(self, trainer: pl.Trainer) -> None:
        environment = self._slurm(trainer)
        if environment is None or not environment.auto_requeue:
            return
        array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
        job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
        result = subprocess.run(["scontrol", "requeue", job], check=False)
        log.warning("requeue of SLURM job %s: %s", job, "done" if result.returncode == 0 else f"failed ({result})")
