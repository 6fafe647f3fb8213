"""``InterruptLog``: say in the log that a run was interrupted, on a rank blocked in a collective too.

[Note: interrupt log]
Python runs a signal handler only between two bytecodes of the main thread. A rank blocked in a gloo collective
when Ctrl-C comes runs none until the collective returns, and under Lightning's popen launcher it may never return:
its peer takes the KeyboardInterrupt first and exits, and the launcher's child observer on rank 0 then SIGKILLs
every process of the job, rank 0 included, before rank 0's ``except KeyboardInterrupt`` runs (measured: 1 run in 6
of ``tests/tools/test_cli.py::test_cli_ctrl_c_leaves_a_trace_in_the_logs`` lost rank 0's line so). So the
interruption is also logged from the collective watchdog's thread, which wakes on every signal whatever the main
thread is doing (:func:`lightning_zero.comm.watchdog.on_signal`, [Note: collective watchdog]). The line is written
once per run, by whichever of that thread and the ``except`` comes first.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import TracebackType

from lightning_zero.comm import watchdog

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class InterruptLog:
    """While the ``with`` block runs, log ``describe()`` as an error once: when SIGINT or SIGTERM arrives (a signal
    with a Python handler: SIGINT's default one, or Lightning's SIGTERM handler), or when :meth:`log_once` is
    called. Enter it in the main thread (it starts the watchdog's thread there)."""

    def __init__(self, logger: logging.Logger, describe: Callable[[], str]) -> None:
        self._logger, self._describe = logger, describe
        self._lock = threading.Lock()
        self.logged = False
        self._remove: Callable[[], None] | None = None

    def log_once(self) -> None:
        with self._lock:
            if not self.logged:
                self.logged = True
                self._logger.error(self._describe())

    def _heard(self, number: int) -> None:
        if number in SIGNALS:
            self.log_once()

    def __enter__(self) -> InterruptLog:
        watchdog.start()
        self._remove = watchdog.on_signal(self._heard)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._remove is not None:
            self._remove()
