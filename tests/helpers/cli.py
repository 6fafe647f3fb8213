"""Run ``lightning-zero-train`` (``python -m lightning_zero.tools.train``) as a subprocess, as a user would.

Lightning's popen launcher re-executes ``sys.argv`` for rank 1, which inside pytest would re-run pytest, so CLI runs
are always subprocesses. Each runs in its own session: on a timeout the whole session is killed, and after a normal
exit :attr:`CliRun.leftover` says whether any process of that session (an orphaned rank) was still alive.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.workers import free_port

# Variables through which a launcher tells Lightning that processes already exist: never leak them into the CLI.
_DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")


@dataclass
class CliRun:
    args: list[str]
    returncode: int
    stdout: str  # stdout and stderr together
    leftover: list[str]  # processes of the run's session that outlived it: 'pid command'


def cli_env(pin_port: bool = True, strip: tuple[str, ...] = ()) -> dict[str, str]:
    """The test process's environment without rank variables (and ``strip``); ``pin_port``: a free ``MASTER_PORT``."""
    drop = (*_DIST_VARS, *strip)
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("PL_", "TORCHELASTIC_"))}
    env.pop("MASTER_PORT", None)
    # PYTHONFAULTHANDLER: a run that hangs is stopped with SIGABRT first (kill_dumping_stacks), and each of its
    # Python processes then prints every thread's stack into the output the failing test shows.
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    if pin_port:
        env["MASTER_PORT"] = str(free_port())
    return env


def _session_members(pgid: int, grace: float = 3.0) -> list[str]:
    """The processes still in process group ``pgid`` after ``grace`` seconds (``pid command`` each).

    The grace covers helpers that exit on their own right after their parent, such as multiprocessing's resource
    tracker (it leaves when its pipe from the spawning process closes).
    """
    deadline = time.monotonic() + grace
    while True:
        ps = subprocess.run(["ps", "-eo", "pid=,pgid=,args="], capture_output=True, text=True, check=True).stdout
        members = [
            f"{pid} {args}"
            for pid, group, args in (line.split(None, 2) for line in ps.splitlines())
            if int(group) == pgid
        ]
        if not members or time.monotonic() > deadline:
            return members
        time.sleep(0.2)


def kill_dumping_stacks(pgid: int, grace: float = 5.0) -> None:
    """Stop session ``pgid`` that hung: SIGABRT first, so that each Python process started with :func:`cli_env`'s
    ``PYTHONFAULTHANDLER`` prints its threads' stacks, then SIGKILL whatever is left after ``grace`` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGABRT)
        time.sleep(grace)
        os.killpg(pgid, signal.SIGKILL)


def stacks_in(output: str, limit: int = 16000) -> str:
    """The threads' stacks that :func:`kill_dumping_stacks` made the run print (innermost frames first), with what
    came just before them; the output's tail when there are none."""
    start = min((i for i in (output.find("Fatal Python error"), output.find("Thread 0x")) if i >= 0), default=-1)
    return output[max(start - 2000, 0) : start + limit] if start >= 0 else output[-limit:]


def run_command(cmd: list[str], cwd: Path, timeout: float, env: dict[str, str]) -> CliRun:
    """Run ``cmd`` in ``cwd`` in its own session; fails the test if it runs past ``timeout`` seconds."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_dumping_stacks(proc.pid)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s:\n{stacks_in(out)}")
    leftover = _session_members(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # nothing may outlive the run, whatever the test asserts
    return CliRun(cmd, proc.returncode, out, leftover)


def run_cli(args: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None) -> CliRun:
    """``python -m lightning_zero.tools.train *args`` in ``cwd`` (see :func:`run_command`)."""
    cmd = [sys.executable, "-m", "lightning_zero.tools.train", *args]
    return run_command(cmd, cwd, timeout, cli_env() if env is None else env)
