"""Start a benchmark's ranks as local processes (no torchrun) and collect what rank 0 reports.

Used by ``benchmarks/ring_allreduce.py`` and ``benchmarks/comm_options.py``. A worker is called as
``worker(rank, world, port, args, results)``: it rendezvouses on ``127.0.0.1:port`` (directly, or through
:func:`torchelastic_env` for a ``Trainer``), and rank 0 puts one picklable object into ``results``.
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def torchelastic_env(rank: int, world: int, port: int) -> None:
    """torchelastic's variables for one local rank: a ``Trainer`` then sees processes created externally and
    launches none."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        LOCAL_WORLD_SIZE=str(world),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def run_ranks(worker: Callable[..., None], world: int, args: argparse.Namespace) -> Any:
    """Run ``worker`` on ``world`` fresh processes; return what rank 0 reported, or raise if a worker failed."""
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results = mp.get_context("spawn").Queue()
    workers = mp.start_processes(worker, args=(world, port, args, results), nprocs=world, join=False)
    while True:
        try:
            reported = results.get(timeout=1)
            break
        except queue.Empty:
            if workers.join(timeout=0):  # raises when a worker failed
                raise RuntimeError(f"the {world} workers exited without results") from None
    while not workers.join():
        pass
    return reported
