"""Collectives that never complete: a bounded wait that names what was pending on every rank, and SIGTERM while stuck.

[Note: collective watchdog] A collective whose peers never arrive (a rank that took another branch, ran a unit one
time more, or stopped) blocks inside the backend: no Python code runs, so no error, and a SIGTERM handler installed by
Lightning never runs either. Three things bound that:

1. **Timed waits** (gloo): every wait of :mod:`lightning_zero.comm.collectives` on a training collective is bounded by
   :data:`TIMEOUT` (the strategies' ``collective_timeout``, default 300 s). When it expires the rank raises
   :class:`CollectiveTimeout`, naming the collective (op, tag, bytes), what the engine was doing
   (:func:`doing`: "all-gather of unit 'blocks.1'", "gradient bucket 3"), and where in training (:func:`at`:
   "training step 12"). It writes that description into the rendezvous store and reads the other ranks' for a few
   seconds, so the error also says what every other rank was waiting in (each rank's watcher thread writes a wait
   that lasts over a second there too; a rank that writes nothing was not waiting in a collective: busy, stuck
   elsewhere, or dead). Coordination around I/O (barriers, object broadcasts, the
   ``"checkpoint"``/``"init"``/``"state_dict"`` tags) is not timed here: a rank may legitimately wait minutes while
   another writes a checkpoint; those fall back to the process group's ``timeout``. On NCCL a timed wait would block
   the CPU on every collective, so waits stay untimed and torch's own watchdog aborts at the process group's
   ``timeout``.
2. **Divergence before the wait**: ZeRO-3 checks its gathers and reductions against the other ranks' before launching
   any that leaves the previous step's plan ([Note: gather sequence check] in
   ``lightning_zero/zero/stage3/gather_order.py``), so a different sequence is an error naming both units at once.
3. **SIGTERM while stuck** (:func:`start`): a thread wakes on the signal
   (``signal.set_wakeup_fd`` writes to a pipe even while the main thread is blocked) and, if the main thread is still
   inside a wait after a grace period, prints the pending collective and exits the process with status 143. Other
   code that must act on a signal while the main thread may be blocked listens through :func:`on_signal` (a process
   has one wakeup fd: this thread owns it).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

DEFAULT_TIMEOUT = 300.0
"""Default ``collective_timeout`` in seconds: far beyond any healthy wait inside a training step (a peer a whole step
behind), far below the 30 minutes a user would wait before killing a hung job."""

TIMEOUT: float | None = None
"""The bound of a timed wait in seconds (``None``: untimed); set by the strategies at setup."""

UNTIMED_OPS = frozenset({"barrier", "broadcast_object", "gather_object"})
UNTIMED_TAGS = frozenset({"checkpoint", "init", "state_dict"})
"""Collectives that coordinate I/O or setup: bounded by the process group's ``timeout`` only."""

SIGTERM_GRACE_S = 5.0
"""How long a SIGTERM may wait for the main thread to leave a collective before the process exits."""

PUBLISH_AFTER_S = 1.0
"""A wait longer than this is written into the rendezvous store (one small write), for the other ranks' messages."""

REPORT_GRACE_S = 10.0
"""How long a rank that timed out collects the other ranks' pending collectives for its message."""

_PREFIX = "lightning_zero/pending"


@dataclass
class _State:
    where: str = ""  # where in training (at)
    doing: tuple[str, ...] = ()  # what the engine is waiting for (doing), innermost last
    waiting: str = ""  # the collective being waited on, with its context, while a wait runs
    since: float = 0.0


_STATE = _State()


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within ``collective_timeout``: its message names it on every rank."""


def configure(timeout: float | None) -> None:
    """Set :data:`TIMEOUT` (seconds; ``None`` turns timed waits off)."""
    global TIMEOUT
    TIMEOUT = timeout


def check_timeout(value: Any) -> float | None:
    """``collective_timeout`` as seconds: ``None``, or a positive number (or ``timedelta``); else one error."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"collective_timeout={value!r} is invalid: expected a number of seconds > 0, or None")
    return float(value)


def at(where: str) -> None:
    """Record where training is (``"training step 12"``), for the messages."""
    _STATE.where = where


@contextmanager
def doing(what: str) -> Iterator[None]:
    """Name what the waits inside are for (``"all-gather of unit 'blocks.1'"``)."""
    _STATE.doing = (*_STATE.doing, what)
    try:
        yield
    finally:
        _STATE.doing = _STATE.doing[:-1]


def timed(op: str, tag: str, group: Any) -> bool:
    """Whether a wait on collective ``op`` with ``tag`` on ``group`` is bounded by :data:`TIMEOUT`."""
    if TIMEOUT is None or op in UNTIMED_OPS or tag in UNTIMED_TAGS:
        return False
    return dist.is_initialized() and dist.get_backend(group) == "gloo"


def describe(label: str) -> str:
    parts = [label, *reversed(_STATE.doing)]
    return "; ".join(parts) + (f" ({_STATE.where})" if _STATE.where else "")


def wait(work: Any, label: str, bounded: bool) -> None:
    """Wait for ``work`` (``label``: op, tag and bytes), bounded by :data:`TIMEOUT` if ``bounded``."""
    previous, previous_since = _STATE.waiting, _STATE.since
    _STATE.waiting, _STATE.since = describe(label), time.monotonic()
    try:
        if not bounded or TIMEOUT is None:
            work.wait()
            return
        try:
            work.wait(timeout=timedelta(seconds=TIMEOUT))
        except RuntimeError as error:  # ours, or the process group's own timeout if that is shorter
            if "timed out" not in str(error).lower():
                raise
            waited = time.monotonic() - _STATE.since
            raise CollectiveTimeout(_timeout_message(_STATE.waiting, waited)) from error
    finally:
        _STATE.waiting, _STATE.since = previous, previous_since


def _timeout_message(what: str, waited: float) -> str:
    me = dist.get_rank()
    others = _peers_pending(me, what)
    lines = [f"rank {r}: " + (others[r] or "no collective of ours pending") for r in sorted(others)]
    return (
        f"lightning_zero: rank {me} waited {waited:.0f} s in {what}, and its peers did not join:"
        " a rank ran a different collective (another branch, a unit run a different number of times), or stopped."
        + (" Meanwhile " + "; ".join(lines) + "." if lines else "")
        + f" collective_timeout is {TIMEOUT:g} s: raise it if a rank can legitimately be this far behind inside a step."
    )


def _peers_pending(me: int, what: str, grace_s: float = REPORT_GRACE_S) -> dict[int, str]:
    """Publish this rank's pending collective in the rendezvous store, then read the others' (a peer that has been
    waiting over :data:`PUBLISH_AFTER_S` published its own; give them ``grace_s`` to do so)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{_PREFIX}/{me}", json.dumps(what))
    except Exception:  # the store may be gone with a dead rank; the message goes without it
        return {}
    peers = [r for r in range(dist.get_world_size()) if r != me]
    out: dict[int, str] = {}
    deadline = time.monotonic() + grace_s
    while True:
        for rank in peers:
            try:
                out[rank] = json.loads(store.get(f"{_PREFIX}/{rank}")) if store.check([f"{_PREFIX}/{rank}"]) else ""
            except Exception:
                out[rank] = ""
        if all(out.values()) or time.monotonic() > deadline:
            return out
        time.sleep(0.5)


def _publish(what: str) -> None:
    """This rank's long wait (or ``""``: none) into the rendezvous store, for a peer's timeout message."""
    with contextlib.suppress(Exception):  # no store (the process group is gone): nothing to tell
        dist.distributed_c10d._get_default_store().set(f"{_PREFIX}/{dist.get_rank()}", json.dumps(what))


# ---------------------------------------------------------------- the watcher thread
_installed = False
_LISTENERS: list[Callable[[int], None]] = []


def on_signal(listener: Callable[[int], None]) -> Callable[[], None]:
    """Call ``listener(signal_number)`` from the watcher thread for every signal that has a Python handler, as it
    arrives, even while the main thread is blocked (the process has one wakeup fd: this thread owns it). Returns
    the function that removes the listener. Start the thread with :func:`start`."""
    _LISTENERS.append(listener)
    return lambda: _LISTENERS.remove(listener) if listener in _LISTENERS else None


def start() -> None:
    """Start the watcher thread (main thread only; once per process): it publishes waits longer than
    :data:`PUBLISH_AFTER_S` and makes a SIGTERM that arrives while this process is blocked in a collective end it.
    Only while a Python handler for SIGTERM is installed (Lightning's, the preemption callback's) does the signal not
    kill the process by itself."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:  # not the main interpreter
        os.close(read_fd)
        os.close(write_fd)
        return
    _installed = True
    threading.Thread(target=_watch, args=(read_fd,), name="lightning_zero-watchdog", daemon=True).start()


def _watch(read_fd: int) -> None:
    published = ""
    while True:
        ready, _, _ = select.select([read_fd], [], [], 0.5)
        received = os.read(read_fd, 64) if ready else b""
        waiting, since = _STATE.waiting, _STATE.since
        long_wait = waiting if waiting and time.monotonic() - since > PUBLISH_AFTER_S else ""
        if long_wait != published and dist.is_initialized():
            _publish(long_wait)
            published = long_wait
        for number in received:
            for listener in list(_LISTENERS):
                listener(number)
        if signal.SIGTERM in received:
            _exit_if_stuck()


def _exit_if_stuck() -> None:
    deadline = time.monotonic() + SIGTERM_GRACE_S
    while _STATE.waiting and time.monotonic() < deadline:
        time.sleep(0.1)
    what, since = _STATE.waiting, _STATE.since
    if what:  # still blocked: the handler cannot run
        rank = dist.get_rank() if dist.is_initialized() else 0
        print(
            f"lightning_zero: rank {rank} received SIGTERM while waiting {time.monotonic() - since:.0f} s in"
            f" {what}; exiting (status 143)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + signal.SIGTERM)
