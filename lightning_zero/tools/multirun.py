"""Multi-process jobs under Hydra multirun (``lightning-zero-train -m ...``).

Lightning's popen launcher starts local ranks 1..N-1 by re-executing ``sys.argv`` with ``hydra.run.dir`` set to
``HydraConfig.get().run.dir``. Under ``-m`` that is wrong three ways: the child re-runs the *whole sweep* (every
job, not this one), ``run.dir`` is the RUN-mode pattern rather than this job's directory, and whatever the first job
leaves behind (``LOCAL_RANK``/``MASTER_PORT`` in ``os.environ``, the default process group) makes the next job
skip launching children or rendezvous on a dead port. :class:`JobScope` wraps one job of a sweep:

* while the job runs, ``sys.argv`` is *this job's* command line: its task overrides (``strategy=zero1_scratch``,
  a sampled ``optimizer.lr=...``), the user's own ``hydra.*`` overrides, ``hydra.mode=RUN`` (a config such as
  ``hparams_search=optuna`` sets ``hydra.mode: MULTIRUN``) and the pinned sweep root and job number; and
  ``hydra.run.dir`` is this job's output directory. Lightning appends that directory, a per-rank job name and
  ``hydra.output_subdir=null``, so rank r >= 1 runs only this job, in this job's directory, logging to
  ``train_ddp_process_<r>.log`` there (rank 0 is this process: its log is the job's own ``train.log``);
* each job picks a free rendezvous port (an inherited ``MASTER_PORT`` is dropped unless the processes were created
  externally, e.g. by torchrun): reusing the previous job's port from the same process was measured to hang;
* at the end of the job (success or not) the children are waited for (and killed after ``child_timeout``), the
  default process group is destroyed, and ``os.environ`` and ``sys.argv`` are restored, so the next job picks a
  fresh port and launches its own children;
* a parallel Hydra launcher (joblib, ray, submitit-local, ...) together with a popen job of several local processes
  is refused before any process starts: concurrent jobs on one host would each re-execute the command line and
  compete for the same devices and ports.

Outside multirun (plain runs, and the re-executed ranks themselves, which run in RUN mode) it only waits for the
ranks rank 0 started, so the command returns after every rank of the run.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from types import TracebackType
from typing import Any

import torch.distributed as dist
from omegaconf import read_write

log = logging.getLogger(__name__)

SEQUENTIAL_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
# hydra.* keys a re-executed rank must not receive from the user's command line: they are set for it.
_PINNED_HYDRA_KEYS = ("hydra.mode", "hydra.run.dir", "hydra.sweep.dir", "hydra.job.name", "hydra.output_subdir")


class LauncherConflictError(RuntimeError):
    """A parallel Hydra launcher would run several multi-process popen jobs at once on this host."""


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def child_argv(task: list[str], hydra_overrides: list[str], sweep_dir: str, job_num: int) -> list[str]:
    """The arguments (after the program) with which a job's extra ranks re-run *only* that job.

    ``task`` and ``hydra_overrides`` are the job's ``hydra.overrides.task`` / ``hydra.overrides.hydra``; the hydra
    overrides that pin the mode and directories are replaced, everything else is passed through.
    """
    passthrough = [o for o in hydra_overrides if not _key(o).startswith(_PINNED_HYDRA_KEYS)]
    return [*task, *passthrough, "hydra.mode=RUN", f'hydra.sweep.dir="{sweep_dir}"', f"hydra.job.num={job_num}"]


def _popen_processes(trainer: Any) -> int:
    """How many local processes Lightning's popen launcher will start for ``trainer`` (1 if it starts none)."""
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    launcher = getattr(trainer.strategy, "launcher", None)
    if not isinstance(launcher, _SubprocessScriptLauncher):
        return 1
    if launcher.cluster_environment.creates_processes_externally:
        return 1
    return launcher.num_processes


class JobScope:
    """Context manager around one run (or one sweep job) of ``lightning-zero-train``; see the module docstring.

    In every mode, rank 0 waits at the end for the ranks it started, so none outlives the command. Under multirun it
    also rewrites the command line the ranks are started with, and restores the process state after the job.

    Args:
        child_timeout: seconds to wait, once rank 0 is done, for the ranks it started before killing them.
        failed_grace: the same once rank 0 has failed.
    """

    def __init__(self, child_timeout: float = 120.0, failed_grace: float = 5.0) -> None:
        self.child_timeout = child_timeout
        self.failed_grace = failed_grace
        self._trainer: Any = None
        self._saved_env: dict[str, str] = {}
        self._saved_argv: list[str] = []
        self.active = False

    def __enter__(self) -> JobScope:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
            return self
        self.active = True
        hydra_cfg = HydraConfig.get()
        self._saved_env, self._saved_argv = dict(os.environ), list(sys.argv)
        if "LOCAL_RANK" not in os.environ and os.environ.pop("MASTER_PORT", None) is not None:
            # Measured: a second job rendezvousing on the first one's port in the same process can hang in process
            # group creation (stale rendezvous state). Ranks started by this process follow whatever port it picks.
            log.warning("MASTER_PORT is ignored under multirun: each job's rank 0 picks a free port of its own")
        sys.argv = [
            sys.argv[0],
            *child_argv(
                list(hydra_cfg.overrides.task),
                list(hydra_cfg.overrides.hydra),
                str(hydra_cfg.sweep.dir),
                int(hydra_cfg.job.num),
            ),
        ]
        # Lightning passes HydraConfig's run.dir to the ranks it starts; make that this job's directory. Hydra sets
        # a fresh HydraConfig for every job, so nothing needs restoring.
        with read_write(hydra_cfg.run):
            hydra_cfg.run.dir = hydra_cfg.runtime.output_dir
        return self

    def attach(self, trainer: Any) -> None:
        """Check ``trainer`` against the Hydra launcher (before anything starts) and remember it for cleanup."""
        self._trainer = trainer
        if not self.active:
            return
        from hydra.core.hydra_config import HydraConfig

        hydra_launcher = HydraConfig.get().launcher.get("_target_", SEQUENTIAL_LAUNCHER)
        processes = _popen_processes(trainer)
        if hydra_launcher != SEQUENTIAL_LAUNCHER and processes > 1:
            raise LauncherConflictError(
                f"the Hydra launcher {hydra_launcher.rsplit('.', 1)[-1]} runs sweep jobs in parallel on this host, "
                f"but each job starts {processes} local processes with Lightning's popen launcher "
                f"({type(trainer.strategy).__name__}, trainer.devices={processes}): their re-executed ranks would "
                "compete for devices and ports. Use the default sequential launcher (hydra/launcher=basic), a "
                "spawn start method (strategy.start_method=spawn) or trainer.devices=1."
            )

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self._reap_children(raise_on_failure=exc_type is None)
        finally:
            if self.active:
                self._restore()

    def _restore(self) -> None:
        """Leave nothing of this job to the next one: process group, rank variables, the command line."""
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        self._trainer = None
        os.environ.clear()
        os.environ.update(self._saved_env)
        sys.argv = self._saved_argv

    def _node_offset(self) -> int:
        """The global rank of this node's local rank 0."""
        trainer = self._trainer
        return int(getattr(trainer, "node_rank", 0)) * int(getattr(trainer, "num_devices", 1))

    def _reap_children(self, raise_on_failure: bool) -> None:
        """Wait for the ranks this job started; a rank that failed fails the job (if nothing else did).

        When rank 0 failed (``raise_on_failure`` false) the others may wait for it in a collective forever: they get
        ``failed_grace`` seconds to notice, not ``child_timeout``.
        """
        launcher = getattr(getattr(self._trainer, "strategy", None), "launcher", None)
        # The popen launcher's children; a spawn launcher joins its own processes before fit returns.
        procs = [p for p in getattr(launcher, "procs", None) or [] if isinstance(p, subprocess.Popen)]
        timeout = self.child_timeout if raise_on_failure else self.failed_grace
        # A rank the Byzantine ranks mode evicted (e.g. one that crashed) is a fault the fit tolerated.
        evicted = getattr(getattr(self._trainer, "strategy", None), "evicted_ranks", frozenset())
        failed = []
        for local_rank, proc in enumerate(procs, start=1):
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.error(
                    "local rank %d (pid %d) still running %.0f s after rank 0 %s: killing it",
                    local_rank,
                    proc.pid,
                    timeout,
                    "finished" if raise_on_failure else "failed",
                )
                proc.kill()
                proc.wait()
            if proc.returncode != 0:
                what = f"local rank {local_rank} (pid {proc.pid}) exited with code {proc.returncode}"
                if self._node_offset() + local_rank in evicted:
                    log.warning("%s: the Byzantine ranks mode had evicted it, and the others finished", what)
                else:
                    failed.append(what)
        if failed and raise_on_failure:
            raise RuntimeError("; ".join(failed))
