"""Hierarchical all-reduce: reduce inside each node, all-reduce across the nodes' leaders, broadcast inside each node.

[Note: hierarchical all-reduce]
A flat all-reduce over ranks spread on several nodes sends its traffic across the slow links between nodes without
regard for where ranks sit: gloo's ring over 2 nodes x 2 ranks crosses each inter-node link with 2(N-1)/N = 1.5 x
the tensor's bytes. Three stages keep the inter-node traffic to what the nodes' leaders exchange:

1. *node reduce*: every node's ranks reduce into its leader (the node's first rank), over the node's group;
2. *leaders' all-reduce*: the leaders (one per node) all-reduce among themselves, over the leaders' group: with M
   nodes each inter-node link carries 2(M-1)/M x the bytes (1 x at M = 2, against 1.5 x for the flat ring at N = 4);
3. *node broadcast*: every leader broadcasts the result over its node's group.

``"avg"`` sums in every stage and the leader divides by the world size before the broadcast, so every rank gets the
same bits. The stages run one after another on one worker thread per process (:class:`NodeGroups`' executor), so a
call with ``async_op=True`` returns at once and the caller (a reducer launching buckets during backward) goes on while
the three stages run; calls are served in the order they were made, which is the same on every rank. The node and
leaders' groups serve only this worker, so its collectives never interleave with the caller's own on another group.
Floating-point sums run in another order than the flat all-reduce's, so results may differ from it in the last bits.

The layout is torchrun's: node k holds global ranks ``k * L .. k * L + L - 1`` for ``L = LOCAL_WORLD_SIZE``
(:func:`node_layout`, pure). The groups are created on first use, by every rank of the world (``dist.new_group`` is a
collective of the default group), so the first hierarchical call must be made by every rank, as any collective is.
"""

from __future__ import annotations

import atexit
import os
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.comm.groups import torch_reduce_op
from lightning_zero.comm.link_model import LAB_LINK_MODEL, LinkModel, choose_all_reduce

REDUCE_OPS = ("sum", "avg", "mean", "max", "min")
"""The ops the hierarchy can split into stages (a product would too, but nothing here needs one)."""


@dataclass(frozen=True)
class NodeLayout:
    """Which global ranks share a node (torchrun's numbering), and the leader of each (its first rank)."""

    nodes: tuple[tuple[int, ...], ...]

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(node[0] for node in self.nodes)

    def node_of(self, rank: int) -> tuple[int, ...]:
        return next(node for node in self.nodes if rank in node)


def node_layout(world_size: int, local_world_size: int) -> NodeLayout:
    """Node k holds ranks ``k * local_world_size`` up to the next node's first."""
    if local_world_size < 1 or world_size < 1 or world_size % local_world_size:
        raise ValueError(
            f"local_world_size={local_world_size} is invalid for world_size={world_size}: expected a divisor of it"
            " (ranks per node, every node alike)"
        )
    nodes = tuple(tuple(range(k, k + local_world_size)) for k in range(0, world_size, local_world_size))
    return NodeLayout(nodes)


def inter_node_bytes(nbytes: int, world_size: int, local_world_size: int, algorithm: str) -> float:
    """Bytes one node sends to the other nodes in one all-reduce of ``nbytes`` (bandwidth term only): the flat ring
    crosses each node's outgoing link with 2(N-1)/N x the bytes, the hierarchy with 2(M-1)/M x for M nodes."""
    nodes = world_size // local_world_size
    if nodes == 1:
        return 0.0
    n = world_size if algorithm == "ring" else nodes
    return 2 * (n - 1) / n * nbytes


class _FutureWork:
    """A :class:`concurrent.futures.Future` with the ``wait(timeout=...)`` of a ``torch.distributed`` work, so the
    shim's handles and the collective watchdog wait on it alike."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            self._future.result(timeout=None if timeout is None else timeout.total_seconds())
        except FutureTimeout:
            raise RuntimeError("hierarchical all-reduce timed out") from None
        return True


class NodeGroups:
    """The node groups and the leaders' group of the default process group, with the worker that runs the stages."""

    def __init__(self, local_world_size: int) -> None:
        self.layout = node_layout(dist.get_world_size(), local_world_size)
        me = dist.get_rank()
        self.node = self.layout.node_of(me)
        self.leader = self.node[0]
        self.is_leader = me == self.leader
        self.world_size = dist.get_world_size()
        self.node_group: Any = None
        for node in self.layout.nodes:  # every rank creates every group, in the same order
            group = dist.new_group(list(node)) if len(node) > 1 else None
            if node == self.node:
                self.node_group = group
        leaders = list(self.layout.leaders)
        group = dist.new_group(leaders) if len(leaders) > 1 else None
        self.leaders_group = group if self.is_leader else None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_zero-hierarchy")

    def submit(self, tensor: Tensor, op: str) -> _FutureWork:
        return _FutureWork(self._worker.submit(self._all_reduce, tensor, op))

    def _all_reduce(self, tensor: Tensor, op: str) -> None:
        # The CUDA device is per thread: this worker's would be cuda:0 whatever the rank's (NCCL needs the tensor's).
        with torch.cuda.device(tensor.device) if tensor.is_cuda else nullcontext():
            self._stages(tensor, op)

    def _stages(self, tensor: Tensor, op: str) -> None:
        average = op in ("avg", "mean")
        reduce_op = torch_reduce_op("sum" if average else op)
        if self.node_group is not None:
            dist.reduce(tensor, dst=self.leader, op=reduce_op, group=self.node_group)
        if self.is_leader:
            if self.leaders_group is not None:
                dist.all_reduce(tensor, op=reduce_op, group=self.leaders_group)
            if average:
                tensor.div_(self.world_size)
        if self.node_group is not None:
            dist.broadcast(tensor, src=self.leader, group=self.node_group)

    def close(self) -> None:
        self._worker.shutdown(wait=True)


_CURRENT: list[tuple[Any, int, NodeGroups]] = []  # (the default group, ranks per node, its groups): at most one


def release() -> None:
    """Stop the hierarchy's worker and drop its groups. Run at exit: a gloo group whose last reference goes during
    the interpreter's finalization can abort the process ("terminate called without an active exception", seen once
    in ``tests/netlab/test_lab.py``'s check after ``destroy_process_group``), so the references go while it is alive."""
    for _, _, old in _CURRENT:
        old.close()
    _CURRENT.clear()


atexit.register(release)


def node_groups(ranks_per_node: int | None = None) -> NodeGroups:
    """The node groups of the current default process group with nodes of ``ranks_per_node`` ranks (default:
    ``LOCAL_WORLD_SIZE``, else one node), created on first use (a collective: every rank)."""
    world = dist.group.WORLD
    if ranks_per_node is None:
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    if _CURRENT and _CURRENT[0][0] is world and _CURRENT[0][1] == ranks_per_node:
        return _CURRENT[0][2]
    release()  # the groups of a destroyed default group, or of another layout
    groups = NodeGroups(ranks_per_node)
    _CURRENT.append((world, ranks_per_node, groups))
    return groups


def launch(tensor: Tensor, op: str, group: Any = None, ranks_per_node: int | None = None) -> _FutureWork:
    """Start the hierarchical all-reduce of ``tensor`` in place (over the default group: ``group`` must be it)."""
    if group is not None and group is not dist.group.WORLD:
        raise ValueError("all_reduce algorithm 'hierarchical' runs over the default process group only: got a subgroup")
    if op not in REDUCE_OPS:
        raise ValueError(f"all_reduce algorithm 'hierarchical' takes op in {REDUCE_OPS}: got {op!r}")
    return node_groups(ranks_per_node).submit(tensor, op)


# ------------------------------------------------------------------------------ what the data-parallel engines use
ALGORITHM_SETTINGS = ("auto", "native", "ring", "hierarchical")
"""The values of a strategy's ``all_reduce_algorithm``."""


def check_algorithm(value: Any) -> None:
    if value not in ALGORITHM_SETTINGS:
        raise ValueError(f"all_reduce_algorithm={value!r} is invalid: expected one of {ALGORITHM_SETTINGS}")


def bucket_algorithm(
    setting: str,
    nbytes: int,
    *,
    backend: str,
    world_size: int,
    ranks_per_node: int,
    link_model: LinkModel | None = None,
) -> str:
    """The all-reduce algorithm of one gradient bucket of ``nbytes`` under ``all_reduce_algorithm=setting``.

    ``"auto"``: on gloo, what :func:`~lightning_zero.comm.link_model.choose_all_reduce` picks under ``link_model``
    (default :data:`~lightning_zero.comm.link_model.LAB_LINK_MODEL`): the hierarchy where the job spans several nodes
    of several ranks each and the bucket is large enough to repay its three stages. Otherwise the backend's own (NCCL's
    rings and trees know the topology)."""
    if setting != "auto":
        return setting
    if backend != "gloo":
        return "native"
    model = LAB_LINK_MODEL if link_model is None else link_model
    return choose_all_reduce(model, nbytes, world_size=world_size, ranks_per_node=ranks_per_node)
