"""Naming the rank that died: what a survivor says when a collective fails because a peer is gone.

When a rank is killed (the OOM killer, a preempted node, ``kill -9``), gloo fails the survivors' next collective
within milliseconds, with a message that names a socket, not a rank (``Read error [127.0.0.1]:32402: Connection
reset by peer``), and NCCL's watchdog says even less. On a few ranks that is a puzzle; on many it is hours of log
reading. So every strategy of ours does this (``on_exception``, for the Trainer and Fabric alike):

1. After the process group is up, each rank writes ``<host>:<pid>`` under its rank into the rendezvous store
   (:func:`record_process`): the store torchrun's agent hosts, or the one rank 0 hosts under Lightning's launchers.
2. When a fit fails with an error that looks like a lost peer (:func:`is_peer_failure`), the rank checks in under
   ``alive/<rank>`` and waits up to ``wait_s`` for the others (:func:`lost_ranks`): a rank that is still alive fails
   its own collective at about the same time and checks in too. Those that do not are named, with what the
   recorded process id says on this host (exited, or still running: then it is hung rather than dead). If the store
   itself is gone, the rank hosting it is (rank 0 under Lightning's launchers).
3. The answer is added to the exception as a note (so the traceback ends with it) and logged on this rank; the
   exception is re-raised unchanged and the process exits non-zero, as before.

Nothing here runs on the training path: one store write at setup, and the probe only after a failure.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)

PREFIX = "lightning_zero/fault"
# What gloo (``pair.cc``), the TCP store and NCCL say when the process at the other end is gone.
_PEER_GONE = re.compile(
    r"Connection (reset|closed) by peer|Broken pipe|Connection refused|remote process exited|"
    r"NCCL communicator was aborted|ncclRemoteError|Socket Timeout",
    re.IGNORECASE,
)


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def record_process(rank: int) -> None:
    """Write this rank's ``host:pid`` into the rendezvous store (after the process group is up)."""
    _store().set(f"{PREFIX}/pid/{rank}", f"{socket.gethostname()}:{os.getpid()}")


def is_peer_failure(exception: BaseException) -> bool:
    """Whether ``exception`` (or what caused it) is a collective failing because a peer process is gone."""
    seen: BaseException | None = exception
    while seen is not None:
        if isinstance(seen, dist.DistNetworkError) or _PEER_GONE.search(str(seen)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _process_state(record: str) -> str:
    """``"exited"``, ``"running"`` or ``""`` (not on this host) for a ``host:pid`` record."""
    host, _, pid = record.rpartition(":")
    if host != socket.gethostname():
        return ""
    stat = Path(f"/proc/{pid}/stat")
    try:  # a killed child of this process (Lightning's popen launcher) stays a zombie until reaped: "Z"
        state = stat.read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "exited"
    return "exited" if state in ("Z", "X") else "running"


def lost_ranks(rank: int, world_size: int, wait_s: float = 3.0) -> str:
    """Check in as alive, wait up to ``wait_s`` for the other ranks, and describe those that did not answer."""
    prefix = PREFIX  # a fresh store per launch and per torchrun attempt ([Note: torchrun restarts])
    try:
        store = _store()
        store.set(f"{prefix}/alive/{rank}", "1")
        others = [r for r in range(world_size) if r != rank]
        deadline = time.monotonic() + wait_s
        missing = others
        while missing and time.monotonic() < deadline:
            time.sleep(0.05)
            missing = [r for r in missing if not store.check([f"{prefix}/alive/{r}"])]
        records = {r: store.get(f"{prefix}/pid/{r}").decode() for r in missing if store.check([f"{prefix}/pid/{r}"])}
    except (RuntimeError, dist.DistError) as error:  # the store went with the rank that hosted it
        host = os.environ.get("MASTER_ADDR", "?") + ":" + os.environ.get("MASTER_PORT", "?")
        return (
            f"rank {rank}: the rendezvous store at {host} is gone too ({type(error).__name__}), so the rank hosting it"
            " has died: rank 0 under Lightning's launchers (under torchrun, its agent)"
        )
    if not missing:
        return f"rank {rank}: every other rank of {world_size} answered after the failure; no rank has died"
    described = []
    for r in missing:
        state = _process_state(records.get(r, ""))
        where = f" ({records[r]}, {state})" if state else (f" ({records[r]})" if r in records else "")
        described.append(f"rank {r}{where}")
    return (
        f"rank {rank}: {', '.join(described)} did not answer within {wait_s:g} s of the failure: dead"
        " (or hung, if still running); see its log for the cause. This rank stops."
    )


def explain(exception: BaseException, rank: int, world_size: int, wait_s: float = 3.0) -> str | None:
    """If ``exception`` is a lost peer, name the lost ranks: add it to the exception as a note and log it."""
    if world_size < 2 or not dist.is_initialized() or not is_peer_failure(exception):
        return None
    message = "lightning_zero: a collective failed because a peer is gone. " + lost_ranks(rank, world_size, wait_s)
    if hasattr(exception, "add_note"):  # Python 3.11+: printed at the end of the traceback
        exception.add_note(message)
    log.error(message)
    return message
