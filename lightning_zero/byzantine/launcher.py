"""The popen launcher of the Byzantine ranks mode: Lightning's, without its child-process observer.

Lightning's ``_SubprocessScriptLauncher`` starts a thread in the main process that polls the ranks it started and,
as soon as one exits with a non-zero status, sends SIGKILL to every rank and to itself ("to avoid zombies"). In the
Byzantine ranks mode that observer is the fault: one crashed rank, which the protocol leaves out and evicts, would
take the honest ranks with it (measured: every ``crash`` cell of ``benchmarks/byzantine_grid.py`` under
``lightning-zero-train`` ended in SIGKILL). Here the ranks outlive one another; more than ``f`` of them gone fails
the step protocol itself, on every honest rank, with an error naming the shards it could not settle, and a rank
blocked in a collective ends by its own timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.fabric.strategies.launchers import subprocess_script as fabric_launchers
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers import subprocess_script as trainer_launchers
from typing_extensions import override


def _launch(launcher: Any, function: Callable, *args: Any, **kwargs: Any) -> Any:
    """``launch`` as Lightning's popen launchers do it, minus ``_launch_process_observer``."""
    launcher.cluster_environment.validate_settings(num_devices=launcher.num_processes, num_nodes=launcher.num_nodes)
    if not launcher.cluster_environment.creates_processes_externally:
        launcher._call_children_scripts()
    _set_num_threads_if_needed(num_processes=launcher.num_processes)
    return function(*args, **kwargs)


class TrainerLauncher(trainer_launchers._SubprocessScriptLauncher):
    """The Trainer's popen launcher in the Byzantine ranks mode."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        return _launch(self, function, *args, **kwargs)


class FabricLauncher(fabric_launchers._SubprocessScriptLauncher):
    """Fabric's popen launcher in the Byzantine ranks mode."""

    @override
    def launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        return _launch(self, function, *args, **kwargs)
