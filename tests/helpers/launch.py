"""Launching test scripts as real jobs (``python script.py`` for Lightning's popen launcher, ``torchrun``): an
environment without this process's distributed variables, and a session stopped as a whole afterwards."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# Variables through which a launcher or scheduler tells Lightning that processes already exist.
DIST_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
DIST_PREFIXES = ("TORCHELASTIC_", "SLURM_", "PL_")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS and not k.startswith(DIST_PREFIXES)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def stop_session(proc: subprocess.Popen, grace: float = 40) -> None:
    """Stop the session this test started for ``proc`` (the launcher and the ranks it started), then reap it.

    A launcher still running gets SIGTERM first: ``torchrun`` starts its workers in sessions of their own and stops
    them only when it is told to (within 30 s). Whatever is left in the session is then killed.
    """
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_script(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int | None, str]:
    """Run ``cmd`` in a session of its own; return its exit code (``None``: it ran past ``timeout``, and was stopped)
    and its output. The output pipe reaches end-of-file only when every process holding it has exited, so the ranks
    a popen launcher started have finished too when this returns."""
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired as expired:
        output, code = expired.output or "", None
        output = output.decode(errors="replace") if isinstance(output, bytes) else output
    finally:
        stop_session(proc)
    return code, output
