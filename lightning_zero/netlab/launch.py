"""Starting a command's ranks on the lab's nodes: one torchrun per node, inside the node's namespace.

Node k runs ``torchrun --nnodes N --nproc-per-node R`` with ``GLOO_SOCKET_IFNAME`` set to the nodes' lab interface,
so every connection between ranks goes through the lab's links ([Note: lab topology] in
``lightning_zero/netlab/topology.py``). A Lightning job inside sees torchrun's environment
(``TorchElasticEnvironment``): give it ``devices=R`` and ``num_nodes=N``.

[Note: the lab's rendezvous]
The torchruns meet through c10d rendezvous on a store the lab itself hosts in node 0's namespace
(``python -m lightning_zero.netlab.probe store``), every torchrun a client (``is_host=false``). With torchrun's
static rendezvous node 0's torchrun hosts the store, and when it leaves its exit barrier first the other nodes'
torchruns, still reading the barrier's last key, fail with a ``DistNetworkError`` trace after a run that succeeded.
The lab's store outlives every torchrun. c10d rendezvous orders the nodes by their ``--local-addr``: each node's
zero-padded host name (``lzlab-node00``, ...), so node k holds global ranks k*R to k*R+R-1, as ``--node-rank`` would.

When one rank or one node's torchrun fails, the others get :data:`GRACE_SECONDS` to notice (our strategies'
collective watchdog ends ranks waiting on a dead peer) and are then killed; the lab returns the exit code of the first
rank that failed (:mod:`lightning_zero.netlab.rank_exit`), else torchrun's own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_zero.netlab.lab import LabError
from lightning_zero.netlab.topology import NODE_INTERFACE, LabPlan, node_address, node_hostname, node_namespace

GRACE_SECONDS = 15.0
BARRIER_SECONDS = 2.0  # after a failure, once every rank has ended: what is left is torchrun's exit barrier
DEFAULT_PORT = 29500  # each node has a namespace of its own: no other job holds a port there


def node_command(plan: LabPlan, k: int, command: Sequence[str], exits: Path, port: int = DEFAULT_PORT) -> list[str]:
    """Node ``k``'s torchrun of ``command``, each rank wrapped to keep its exit code in ``exits``."""
    return [
        "ip", "netns", "exec", node_namespace(k),
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={plan.nodes}", f"--nproc-per-node={plan.ranks_per_node}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={node_address(0)}:{port}", "--rdzv-id=lzlab",
        "--rdzv-conf=is_host=false", f"--local-addr={node_hostname(k)}",
        "--module", "lightning_zero.netlab.rank_exit", str(exits), *command,
    ]  # fmt: skip


LAB_VARIABLE = "LIGHTNING_ZERO_NETLAB"
"""Set in every rank to the lab's options (``--nodes 2 ... --inter-node 1gbit``): a job can say where it ran."""


def rank_environment(plan: LabPlan) -> dict[str, str]:
    """The environment of every node's torchrun: this one, with gloo bound to the lab interface, :data:`LAB_VARIABLE`,
    and torchrun's own default of one OpenMP thread per rank (set here so that it prints no banner per node)."""
    return {
        "OMP_NUM_THREADS": "1",
        **os.environ,
        "GLOO_SOCKET_IFNAME": NODE_INTERFACE,
        LAB_VARIABLE: plan.command_line(),
    }


def rank_codes(exits: Path) -> list[tuple[int, int]]:
    """``(when, code)`` of each rank that has ended, as its wrapper wrote them."""
    ended = []
    for path in exits.glob("rank*.rc"):
        ended.append((path.stat().st_mtime_ns, int(path.read_text())))  # written whole (rank_exit renames it)
    return ended


def exit_code(exits: Path, torchrun_codes: Sequence[int | None]) -> int:
    """The first failed rank's own exit code (by when it ended), else the first non-zero torchrun code, else 0."""
    failed = [(when, code) for when, code in rank_codes(exits) if code != 0]
    if failed:
        return min(failed)[1]
    return next((code for code in torchrun_codes if code), 0)


def _kill(process: subprocess.Popen[Any], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)


def run_command(plan: LabPlan, command: Sequence[str], port: int = DEFAULT_PORT) -> int:
    """Run ``command``'s ranks on the lab's nodes until every node ends; their exit code (module docstring)."""
    with tempfile.TemporaryDirectory(prefix="lzlab-exits-") as tmp:
        exits = Path(tmp)
        store = subprocess.Popen(
            ["ip", "netns", "exec", node_namespace(0), sys.executable, "-m", "lightning_zero.netlab.probe", "store",
             node_address(0), str(port)], stdout=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        assert store.stdout is not None
        if store.stdout.readline().strip() != "ready":
            raise LabError(f"the lab's rendezvous store did not start in {node_namespace(0)}")
        nodes = [
            subprocess.Popen(
                node_command(plan, k, command, exits, port), env=rank_environment(plan), start_new_session=True
            )
            for k in range(plan.nodes)
        ]
        failed_at: float | None = None
        try:
            while any(p.poll() is None for p in nodes):
                # A rank's failure counts from when it ended: the torchrun of a node whose ranks all ended waits in
                # its exit barrier for the other nodes' torchruns, which wait on ranks blocked by the failed one.
                ended = rank_codes(exits)
                failed = any(p.returncode not in (None, 0) for p in nodes) or any(c for _, c in ended)
                if failed_at is None and failed:
                    failed_at = time.monotonic()
                grace = BARRIER_SECONDS if len(ended) == plan.world_size else GRACE_SECONDS  # none left to notice
                if failed_at is not None and time.monotonic() - failed_at > grace:
                    for p in nodes:
                        _kill(p, signal.SIGKILL)
                time.sleep(0.1)
        except KeyboardInterrupt:
            for p in nodes:  # torchrun passes SIGINT on to its ranks; the lab kills what is left on leaving
                _kill(p, signal.SIGINT)
            deadline = time.monotonic() + 5
            while any(p.poll() is None for p in nodes) and time.monotonic() < deadline:
                time.sleep(0.1)
            for p in nodes:
                _kill(p, signal.SIGKILL)
            raise
        finally:
            _kill(store, signal.SIGKILL)
            store.wait()
        return exit_code(exits, [p.returncode for p in nodes])
