"""``InterruptLog`` and the watchdog's signal listeners: a signal is heard from the watcher thread, logged once."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator

import pytest

from lightning_zero.comm import watchdog
from lightning_zero.tools.interrupts import InterruptLog


@pytest.fixture
def quiet_sigterm() -> Iterator[None]:
    """SIGTERM with a Python handler that does nothing (the interpreter then writes it to the wakeup fd)."""
    previous = signal.signal(signal.SIGTERM, lambda number, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _until(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_listener_hears_each_signal_from_the_watcher_thread(quiet_sigterm: None) -> None:
    heard: list[int] = []
    watchdog.start()
    remove = watchdog.on_signal(heard.append)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert _until(lambda: signal.SIGTERM in heard)
    finally:
        remove()
    heard.clear()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.7)  # the watcher polls every 0.5 s at the latest
    assert heard == []  # removed: it hears nothing more


def test_interrupt_log_writes_its_line_once(quiet_sigterm: None, caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("tests.interrupts")
    with caplog.at_level(logging.ERROR, logger="tests.interrupts"), InterruptLog(logger, lambda: "stopped at 3") as log:
        os.kill(os.getpid(), signal.SIGTERM)
        assert _until(lambda: log.logged)
        log.log_once()  # the except path after the watcher: no second line
    assert [r.getMessage() for r in caplog.records if r.name == "tests.interrupts"] == ["stopped at 3"]


def test_interrupt_log_from_the_except_path_alone(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("tests.interrupts")
    with caplog.at_level(logging.ERROR, logger="tests.interrupts"), InterruptLog(logger, lambda: "stopped") as log:
        assert not log.logged
        log.log_once()
        log.log_once()
    assert [r.getMessage() for r in caplog.records if r.name == "tests.interrupts"] == ["stopped"]
