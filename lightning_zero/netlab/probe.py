"""What ``lightning-zero-netlab --check`` measures, run inside the lab: a TCP stream over one link, and the collectives
of :mod:`lightning_zero.comm.collectives` from 4 KiB up, rank by rank under torchrun.

Runbook (the lab runs these; by hand only to debug one)::

    python -m lightning_zero.netlab.probe stream-server 198.18.0.2 5201 33554432     # in node 1's namespace
    python -m lightning_zero.netlab.probe stream-client 198.18.0.2 5201 33554432     # in node 0's
    torchrun ... -m lightning_zero.netlab.probe collectives OUT.json 268435456       # every rank

A collective's ``size`` is the full tensor, as in ``benchmarks/collectives.py`` (all-reduce and broadcast tensor,
reduce-scatter input, all-gather output, all-to-all input per rank), so rows of one size move comparable data. Every
call starts after a barrier and its time is the slowest rank's; the first call of each collective is a warm-up.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_zero.comm import collectives as comm
from lightning_zero.comm import hierarchy

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
LEVEL_PROBES = ("intra_node", "inter_node", "all_reduce_hierarchical")
"""Measured where the lab has them: the all-reduce inside one node (over its ranks), across the nodes (over their
leaders, one rank per node), and the shim's hierarchical all-reduce over the world; the first two give the link
model's levels (:func:`lightning_zero.netlab.check.link_model`)."""
SMALLEST = 4 << 10


def sizes(largest: int) -> list[int]:
    """4 KiB, 16 KiB, ... (x4) up to ``largest`` bytes."""
    out, size = [], SMALLEST
    while size <= largest:
        out.append(size)
        size *= 4
    return out


def repetitions(nbytes: int) -> int:
    """Timed calls per size: more where a call is short and noisy, one where it takes seconds on a slow link."""
    return 5 if nbytes <= 1 << 20 else 3 if nbytes <= 16 << 20 else 1


# ------------------------------------------------------------------------------------------------------ streams
def stream_server(host: str, port: int, nbytes: int) -> None:
    """Receive ``nbytes`` on one TCP connection; print ``{"bytes", "seconds"}`` from first to last byte."""
    with socket.create_server((host, port)) as server:
        print("ready", flush=True)
        connection, _ = server.accept()
        with connection:
            got, start = 0, None
            while got < nbytes:
                chunk = connection.recv(1 << 20)
                if not chunk:
                    break
                start = time.perf_counter() if start is None else start
                got += len(chunk)
            seconds = time.perf_counter() - (start or time.perf_counter())
    print(json.dumps({"bytes": got, "seconds": seconds}), flush=True)


def stream_client(host: str, port: int, nbytes: int) -> None:
    """Send ``nbytes`` to ``host:port`` as fast as TCP takes them."""
    block = b"\0" * (1 << 20)
    with socket.create_connection((host, port), timeout=60) as connection:
        for offset in range(0, nbytes, len(block)):
            connection.sendall(block[: min(len(block), nbytes - offset)])


# -------------------------------------------------------------------------------------------------- collectives
def _operation(name: str, nbytes: int, world: int) -> Callable[[], object]:
    numel = max(world, nbytes // 4 // world * world)  # fp32, divisible into one chunk per rank
    full, chunk = torch.ones(numel), torch.ones(numel // world)
    if name == "all_reduce":
        return lambda: comm.all_reduce(full, tag="netlab")
    if name == "all_gather":
        return lambda: comm.all_gather(full, chunk, tag="netlab")
    if name == "reduce_scatter":
        return lambda: comm.reduce_scatter(chunk, full, tag="netlab")
    if name == "all_to_all":
        inputs, outputs = list(full.chunk(world)), list(torch.empty_like(full).chunk(world))
        return lambda: comm.all_to_all(outputs, inputs, tag="netlab")
    if name == "broadcast":
        return lambda: comm.broadcast(full, src=0, tag="netlab")
    raise ValueError(f"collective={name!r} is invalid: expected one of {COLLECTIVES}")


def _level_operation(name: str, nbytes: int) -> tuple[Callable[[], object] | None, int]:
    """A level probe's call on this rank (``None`` where this rank takes no part: a non-leader across the nodes) and
    the size of the group it runs over; ``None, 0`` where the lab lacks the level."""
    world, per_node = dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    nodes = world // per_node
    full = torch.ones(max(1, nbytes // 4))
    if name == "all_reduce_hierarchical":
        if per_node == 1 or nodes == 1:
            return None, 0
        return (lambda: comm.all_reduce(full, "avg", tag="netlab", algorithm="hierarchical")), world
    if (name == "intra_node" and per_node == 1) or (name == "inter_node" and nodes == 1):
        return None, 0
    if per_node == 1:  # one rank per node: the world is the leaders' group
        return (lambda: comm.all_reduce(full, tag="netlab")), world
    groups = hierarchy.node_groups(per_node)
    group = groups.node_group if name == "intra_node" else groups.leaders_group
    if group is None:
        return None, nodes
    return (lambda: comm.all_reduce(full, group=group, tag="netlab")), per_node if name == "intra_node" else nodes


def collectives(out: str, largest: int) -> None:
    """Time every collective (and every level probe the lab has) at every size up to ``largest`` bytes; rank 0 writes
    ``{"points": {name: [[bytes, s], ...]}, "group_sizes": {level probe: ranks}}``."""
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    local: list[float] = []  # every timed call in order, this rank's seconds (0 where it takes no part)
    plan = []  # (name, bytes, calls), the same on every rank
    group_sizes: dict[str, int] = {}
    hierarchy.node_groups(int(os.environ.get("LOCAL_WORLD_SIZE", world)))  # a collective: every rank, first
    for name in COLLECTIVES + LEVEL_PROBES:
        for k, nbytes in enumerate(sizes(largest)):
            if name in COLLECTIVES:
                run: Callable[[], object] | None = _operation(name, nbytes, world)
            else:
                run, group_sizes[name] = _level_operation(name, nbytes)
                if not group_sizes[name]:
                    del group_sizes[name]
                    break
            if k == 0 and run is not None:
                run()  # the first call of a collective makes its connections
            calls = repetitions(nbytes)
            for _ in range(calls):
                dist.barrier()
                start = time.perf_counter()
                if run is not None:
                    run()
                local.append(time.perf_counter() - start if run is not None else 0.0)
            plan.append((name, nbytes, calls))
    slowest = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        points: dict[str, list[list[float]]] = {name: [] for name, _, _ in plan}
        at = 0
        for name, nbytes, calls in plan:
            points[name].append([nbytes, statistics.median(slowest[at : at + calls].tolist())])
            at += calls
        with open(out, "w") as file:
            json.dump({"world_size": world, "points": points, "group_sizes": group_sizes}, file)
    hierarchy.release()  # before the groups are destroyed: none of them may outlive the interpreter
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ rendezvous
def store(host: str, port: int) -> None:
    """Host the lab's rendezvous store until killed ([Note: the lab's rendezvous] in ``netlab/launch.py``)."""
    from datetime import timedelta

    server = dist.TCPStore(host, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                           timeout=timedelta(hours=24))  # fmt: skip
    print("ready", flush=True)
    while server is not None:
        time.sleep(3600)


def main(argv: list[str]) -> int:
    command, args = argv[0], argv[1:]
    if command == "store":
        store(args[0], int(args[1]))
    elif command == "stream-server":
        stream_server(args[0], int(args[1]), int(args[2]))
    elif command == "stream-client":
        stream_client(args[0], int(args[1]), int(args[2]))
    elif command == "collectives":
        collectives(args[0], int(args[1]))
    else:
        print(f"unknown probe {command!r}: expected stream-server, stream-client or collectives", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
