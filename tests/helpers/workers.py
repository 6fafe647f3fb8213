"""Run a function on N local worker processes that look like ``torchrun`` ranks to Lightning.

Each worker gets the torchelastic variables (``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``, ``LOCAL_WORLD_SIZE``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so a ``Trainer`` inside it detects processes created externally
and launches nothing. One worker lifetime can then run several fits (the process group is created by the first and
reused).

Workers are forked from a *forkserver* that imported torch, Lightning and lightning_zero once per test session
(:data:`PRELOAD`): a fresh spawned interpreter spends seconds on those imports (8-30 s for two ranks on this
machine, depending on load), a forked one 0.2 s. The forkserver never runs torch ops, so no thread pool or CUDA
context is inherited. Its environment is the one of the session's first call, so a test whose workers must read a
variable at process start (glibc's ``MALLOC_*``) passes ``start_method="spawn"``.

``fn`` must be importable by name (it is pickled by reference); its return value must be picklable.
"""

from __future__ import annotations

import io
import os
import socket
import time
import traceback
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any, leaving: int) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        LOCAL_WORLD_SIZE=str(world_size),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    succeeded = False
    try:
        # Bytes, not tensors: torch would pass tensors through shared memory owned by this process, which exits.
        buffer = io.BytesIO()
        torch.save(fn(*args), buffer)
        queue.put((rank, "ok", buffer.getvalue()))
        succeeded = True
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            _leave_together(leaving, wait=succeeded)
            torch.distributed.destroy_process_group()


def _leave_together(world_size: int, wait: bool, timeout: float = 30) -> None:
    """Count this rank out in the rendezvous store, and (``wait``) stay until ``world_size`` ranks are out.

    Rank 0 hosts the store: a rank 0 that exits while a peer still reads it (the peer's last ``new_group``
    exchanging addresses) fails that peer with "Gloo connectFullMesh failed ... Connection closed by peer". A count in
    the store, not a barrier: a test may leave the process group broken on purpose (a peer timed out), and the store
    still works then. A rank that failed does not wait: its exit is what ends its peers' pending collectives, which
    tests of failures time. A store that is gone (its host left) ends the wait."""
    key = "tests.helpers.workers/done"
    try:
        store = torch.distributed.distributed_c10d._get_default_store()
        store.add(key, 1)
        deadline = time.monotonic() + timeout
        while wait and store.add(key, 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.01)
    except RuntimeError:  # torch's DistStoreError: the host of the store has exited
        pass


PRELOAD = ["torch", "torch.distributed", "lightning", "lightning.pytorch", "lightning_zero", __name__]
"""What the forkserver imports before forking workers."""


def run_workers(
    fn: Callable, world_size: int, *args: Any, timeout: float = 240, start_method: str = "forkserver",
    dies: Collection[int] = (),
) -> list[Any]:  # fmt: skip
    """Run ``fn(*args)`` on ``world_size`` processes; return the results ordered by rank, or raise the first error.
    ``start_method``: ``"forkserver"`` (see the module docstring) or ``"spawn"`` (fresh interpreters). ``dies``: ranks
    that must exit on their own without a result (a crash under test): their place holds the exit status, and one
    that returns or exits 0 is an error."""
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts, on the session's first call
    queue = ctx.Queue()
    port = free_port()
    leaving = world_size - len(set(dies))
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, leaving)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(leaving):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            if rank in dies:
                raise RuntimeError(f"rank {rank} was to die but returned a result")
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        for rank in dies:
            procs[rank].join(timeout=30)
            if procs[rank].exitcode in (0, None):
                raise RuntimeError(f"rank {rank} was to die, but its exit status is {procs[rank].exitcode}")
            results[rank] = procs[rank].exitcode
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
