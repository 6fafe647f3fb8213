"""Start a benchmark's ranks as local processes (no torchrun) and collect what rank 0 reports; or, under torchrun
(``lightning-zero-netlab`` starts one per simulated node), run this process's rank of them.

Used by ``benchmarks/ring_allreduce.py``, ``benchmarks/comm_options.py`` and ``benchmarks/powersgd_compute.py``. A
worker is called as ``worker(rank, world, port, args, results)``: it rendezvouses through :func:`init_gloo` (or
:func:`torchelastic_env` for a ``Trainer``, whose devices and nodes :func:`trainer_layout` gives), and rank 0 puts
one picklable object into ``results``. So the same command runs on one machine and inside the lab:

    python benchmarks/comm_options.py
    lightning-zero-netlab --nodes 2 --inter-node 1gbit -- python benchmarks/comm_options.py
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def launched() -> bool:
    """Whether torchrun started this process as one rank of the job (then the job's ranks exist already)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def launched_world(default: int) -> int:
    """The launched job's world size under torchrun, else ``default``."""
    return int(os.environ["WORLD_SIZE"]) if launched() else default


def launch_prefix(torchrun_ranks: int | None = None) -> str:
    """How a reproduce line starts: inside ``lightning-zero-netlab``, its command (it starts torchrun itself); else
    ``torchrun --nproc_per_node N`` for a torchrun benchmark, ``python`` for one that starts its own ranks."""
    lab = os.environ.get("LIGHTNING_ZERO_NETLAB")
    if lab:
        return f"lightning-zero-netlab {lab} -- python"
    return f"torchrun --nproc_per_node {torchrun_ranks}" if torchrun_ranks is not None else "python"


def reports() -> bool:
    """Whether this process prints the benchmark's output: the only one, or rank 0 of a torchrun job."""
    return os.environ.get("RANK", "0") == "0" if launched() else True


def trainer_layout(world: int) -> tuple[int, int]:
    """``(devices, num_nodes)`` of a ``Trainer`` over ``world`` ranks: torchrun's ranks per node and nodes, else
    ``world`` local processes on one node."""
    if launched():
        local = int(os.environ["LOCAL_WORLD_SIZE"])
        return local, world // local
    return world, 1


def init_gloo(rank: int, world: int, port: int) -> None:
    """The gloo process group: torchrun's rendezvous (``env://``) when launched, else ``127.0.0.1:port``."""
    if launched():
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def torchelastic_env(rank: int, world: int, port: int) -> None:
    """torchelastic's variables for one local rank: a ``Trainer`` then sees processes created externally and
    launches none. Under torchrun they are set already, and kept."""
    if launched():
        return
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
    """Run ``worker`` on ``world`` fresh processes; return what rank 0 reported, or raise if a worker failed.

    Under torchrun this process runs its own rank of ``worker`` instead: rank 0 returns what it reported, the other
    ranks exit when their part is done (only rank 0 reports)."""
    if launched():
        started = int(os.environ["WORLD_SIZE"])
        if world != started:
            sys.exit(f"this benchmark asks for {world} ranks, but torchrun started {started}: ask for {started}")
        inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        rank = int(os.environ["RANK"])
        worker(rank, world, 0, args, inbox)
        if rank != 0:
            sys.exit(0)
        return inbox.get_nowait()
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
