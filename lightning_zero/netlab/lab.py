"""Building and removing a lab on this machine: the checks before anything is made, and the cleanup after.

:class:`NetLab` is a context manager: entering it checks the machine (:func:`preflight`), then runs the plan's
commands ([Note: lab topology] in ``lightning_zero/netlab/topology.py``); leaving it, by any path, removes every
namespace it made, after killing the processes still inside them. :func:`cleanup` removes what a killed lab left
behind: every namespace whose name starts with the lab's prefix, and nothing else.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

from lightning_zero.netlab.topology import HUB, PREFIX, LabPlan

TOOLS = ("ip", "tc")
ETC_NETNS = Path("/etc/netns")  # ip netns exec bind-mounts /etc/netns/<ns>/<file> over /etc/<file>


class LabError(RuntimeError):
    """The lab cannot be built here, or a command building it failed; the message says which and why."""


Runner = Callable[[Sequence[str]], str]


def run(command: Sequence[str]) -> str:
    """Run one ``ip``/``tc`` command; its stdout, or :class:`LabError` with the command and its stderr."""
    done = subprocess.run(list(command), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise LabError(
            f"`{' '.join(command)}` failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}"
        )
    return done.stdout


def namespaces(runner: Runner = run) -> list[str]:
    """The network namespaces of this machine (``ip netns list`` prints ``name`` or ``name (id: N)``)."""
    return [line.split()[0] for line in runner(["ip", "netns", "list"]).splitlines() if line.strip()]


def preflight(plan: LabPlan, runner: Runner = run) -> None:
    """Refuse, with one line, a machine the lab cannot run on: not root, no iproute2, or a lab name taken."""
    if os.geteuid() != 0:
        raise LabError("lightning-zero-netlab needs root (it makes network namespaces and tc qdiscs): run it as root")
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise LabError(f"lightning-zero-netlab needs `ip` and `tc` from iproute2: not found: {', '.join(missing)}")
    taken = sorted(set(plan.namespaces) & set(namespaces(runner)))
    if taken:
        raise LabError(
            f"network namespace {', '.join(taken)} already exists: another lab is running, or a killed one left it"
            " behind (lightning-zero-netlab --cleanup removes it)"
        )


def _kill_inside(namespace: str, runner: Runner) -> None:
    """SIGKILL every process still in ``namespace``: a rank stuck in a gloo call runs no handler for SIGTERM."""
    try:
        pids = runner(["ip", "netns", "pids", namespace]).split()
    except LabError:
        return
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def remove(names: Sequence[str], runner: Runner = run) -> list[str]:
    """Delete the namespaces ``names`` (their interfaces and qdiscs go with them); the errors, one line each."""
    errors = []
    for name in names:
        _kill_inside(name, runner)
        try:
            runner(["ip", "netns", "delete", name])
        except LabError as err:
            errors.append(str(err))
        shutil.rmtree(ETC_NETNS / name, ignore_errors=True)
    return errors


def cleanup(runner: Runner = run) -> list[str]:
    """Remove every namespace whose name starts with the lab's prefix; the names removed."""
    found = [name for name in namespaces(runner) if name.startswith(f"{PREFIX}-")]
    found += [p.name for p in ETC_NETNS.glob(f"{PREFIX}-*") if p.name not in found]  # a lab killed while building
    errors = remove(found[::-1], runner)
    if errors:
        raise LabError("; ".join(errors))
    return found


class NetLab:
    """The lab of ``plan`` while the ``with`` block runs (module docstring)."""

    def __init__(self, plan: LabPlan, runner: Runner = run) -> None:
        self.plan = plan
        self._runner = runner
        self._made: list[str] = []  # namespaces this lab made, in the order it made them

    def __enter__(self) -> NetLab:
        preflight(self.plan, self._runner)
        try:
            for command in self.plan.setup_commands():
                self._runner(command)
                if command[:3] == ["ip", "netns", "add"]:
                    self._made.append(command[3])
                    if command[3] != HUB:
                        (ETC_NETNS / command[3]).mkdir(parents=True, exist_ok=True)
                        (ETC_NETNS / command[3] / "hosts").write_text(self.plan.hosts_file())
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Remove what this lab made (the nodes before the hub); safe to call twice."""
        made, self._made = self._made, []
        errors = remove(made[::-1], self._runner)
        if errors:
            raise LabError("the lab could not remove all it made: " + "; ".join(errors))
