"""Sharded and replicated robust aggregation across ranks: which columns each rank sends to whom, the totals of the
partial sums, the digests of replicated results, and the aggregate gathered back ([Note: sharded aggregation] and
[Note: replicated aggregation] in :mod:`lightning_zero.robust.shards`, which holds the pure math).

Runbook (inside :class:`~lightning_zero.robust.engine.RobustEngine`, with ``sharded_aggregation=True``)::

    exchange = ShardedExchange(replicas=2)
    exchange.reset(groups=None)                 # attach: contiguous shards (robust ZeRO: its flat groups)
    exchange.send(grads, worker)                # after a worker's last backward of the window: its all-to-all starts
    result, vector = exchange.aggregate(grads, aggregator)   # the rounds, the digests, the aggregate all-gathered
    exchange.sink = optimizer_engine.set_shard_grads         # robust ZeRO: the shard goes there, vector is None
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable

import torch
from torch import Tensor

from lightning_zero.comm import collectives as comm
from lightning_zero.robust.aggregation import AggregationResult, RobustAggregator
from lightning_zero.robust.shards import ColumnLayout, ColumnShard, aggregating_ranks, round_shards
from lightning_zero.robust.workers import WorkerGradients


class AggregationMismatchError(RuntimeError):
    """Replicated aggregation: the ranks that aggregated one shard disagree, or a gathered shard is not the one they
    agreed on ([Note: replicated aggregation] in :mod:`lightning_zero.robust.shards`). Raised on every rank before any
    rank applies the step."""


def digest(tensor: Tensor) -> bytes:
    """The BLAKE2b digest (16 bytes) of ``tensor``'s values, bit for bit."""
    data = tensor.detach().contiguous().cpu().view(torch.uint8).numpy()
    return hashlib.blake2b(memoryview(data), digest_size=16).digest()


def gather_shards(mine: Tensor, layout: ColumnLayout, out: Tensor | None = None, tag: str = "aggregate") -> Tensor:
    """Every rank's shard of ``layout`` (this rank's: ``mine``) all-gathered into one ``(width,)`` vector: into the
    zeroed, padded ``out`` of ``world_size x`` the largest shard's size (default: a new one), a view of which is
    returned for a contiguous layout, or a new vector assembled from it."""
    world, me = comm.world_size(), comm.rank()
    size = max(layout.size(r) for r in range(world))
    out = mine.new_zeros(size * world) if out is None else out
    slot = out.narrow(0, me * size, size)
    slot[: layout.size(me)].copy_(mine)
    comm.all_gather(out, slot, tag=tag)
    if layout.is_contiguous:
        return out[: layout.width]
    vector = mine.new_empty(layout.width)
    for r in range(world):
        layout.put(vector, r, out.narrow(0, r * size, layout.size(r)))
    return vector


def gather_rows(rows: Tensor, out: Tensor | None, tag: str) -> Tensor:
    """Every rank's ``(k, d)`` worker rows into ``out`` (``(n, d)``, collective), in global worker order, returned;
    one process returns ``rows`` themselves (``out`` may then be ``None``)."""
    if comm.world_size() == 1:
        return rows
    assert out is not None, "gather_rows across ranks needs its (n, d) output"
    comm.all_gather(out, rows, tag=tag)
    return out


def _columns(layout: ColumnLayout, shard: int) -> str:
    return ", ".join(f"[{lo}, {hi})" for lo, hi in layout.shards[shard]) or "none"


class ShardedExchange:
    """One engine's sharded aggregation over the default process group.

    Args:
        replicas: ``r``, the ranks that aggregate each shard (1: no replication, no digests).
    """

    def __init__(self, replicas: int = 1) -> None:
        self.replicas = replicas
        self.received: list[Tensor] = []
        """Every worker's columns of this rank's shards, one ``(n, columns)`` stack per round, in global worker order;
        kept from step to step."""
        self.sink: Callable[[Tensor, set[str]], None] | None = None
        """Robust ZeRO: takes this rank's aggregated shard (its optimizer shard's gradient), which is then not
        all-gathered, and the names of the parameters no rank used in the window."""
        self._aggregate: Tensor | None = None  # the padded aggregate the shards are all-gathered into
        self._groups: list[list[int]] | None = None
        self._layout: ColumnLayout | None = None
        self._sent: dict[int, list[comm.Handle]] = {}  # the exchanges started this window, by local worker

    def reset(self, groups: list[list[int]] | None) -> None:
        """A new run: ``groups`` lists ZeRO's flat groups by parameter index (robust ZeRO), else ``None``."""
        self._groups, self._layout, self._aggregate, self._sent, self.received = groups, None, None, {}, []

    @property
    def buffers(self) -> list[Tensor]:
        """The received stacks and the gathered aggregate."""
        return self.received + ([self._aggregate] if self._aggregate is not None else [])

    def layout(self, numels: list[int]) -> ColumnLayout:
        """The column shards of vectors over parameters of ``numels``: contiguous, or the optimizer shards of the
        groups given to :meth:`reset`."""
        world, width = comm.world_size(), sum(numels)
        if self._layout is None or self._layout.width != width or self._layout.world_size != world:
            if self._groups is None:
                self._layout = ColumnLayout.contiguous(width, world)
            else:
                self._layout = ColumnLayout.of_groups(numels, self._groups, world)
        return self._layout

    def _shards(self) -> list[int]:
        return round_shards(comm.rank(), comm.world_size(), self.replicas)

    def send(self, grads: WorkerGradients, worker: int) -> None:
        """Start local ``worker``'s all-to-all: its vector's columns to the ranks that aggregate them, every worker's
        columns of this rank's shards into :attr:`received` (once per window; a worker already sent is skipped)."""
        if worker in self._sent:
            return
        world, k = comm.world_size(), grads.workers
        layout = self.layout(grads.numels)
        shards = self._shards()
        shapes = [(k * world, layout.size(s)) for s in shards]
        if not self._sent and [tuple(t.shape) for t in self.received] != shapes:  # the window's first send
            self.received = [grads.rows.new_empty(shape) for shape in shapes]
        vector = grads.vector(worker)
        self._sent[worker] = []
        for j, mine in enumerate(shards):  # row ``worker`` of rank ``q`` is worker ``q k + worker``
            sizes = [hi - lo for lo, hi in layout.shards[mine]]
            inputs = [[vector[lo:hi] for lo, hi in layout.shards[(q - j) % world]] for q in range(world)]
            outputs = [list(self.received[j][q * k + worker].split(sizes)) for q in range(world)]
            self._sent[worker].append(comm.all_to_all(outputs, inputs, async_op=True, tag="worker_grads"))

    def aggregate(
        self, grads: WorkerGradients, aggregator: RobustAggregator, unused: set[str] = frozenset()
    ) -> tuple[AggregationResult, Tensor | None]:
        """Every worker sent (those not yet now) and received, the rounds aggregated, their digests compared; round
        0's shard handed to :attr:`sink` with ``unused`` (the parameters no rank used; ``None`` returned), or the
        aggregate all-gathered from round 0's ranks and returned."""
        for worker in range(grads.workers):
            self.send(grads, worker)
        for handles in self._sent.values():
            for handle in handles:
                handle.wait()
        self._sent = {}
        layout = self.layout(grads.numels)
        generator = aggregator.generator
        state = generator.get_state()
        results = []
        for j, (s, stack) in enumerate(zip(self._shards(), self.received)):
            if j:  # every round draws what round 0 drew
                generator.set_state(state)
            shard = ColumnShard(s, layout.shards[s], layout.width, total=functools.partial(self._total, j))
            results.append(aggregator(stack, shard))
        agreed = self._compare_digests(results, layout) if self.replicas > 1 else None
        result = dataclasses.replace(results[0], seconds=sum(r.seconds for r in results))
        if self.sink is not None:
            self.sink(results[0].vector, unused)
            return result, None
        size = max(layout.size(r) for r in range(layout.world_size)) * layout.world_size
        if self._aggregate is None or self._aggregate.shape[0] != size or self._aggregate.dtype != grads.rows.dtype:
            self._aggregate = grads.rows.new_zeros(size)  # the padding stays zero; the p.grad are views of it
        vector = gather_shards(results[0].vector, layout, self._aggregate)
        if agreed is not None:
            self._verify_gathered(vector, agreed, layout)
        return result, vector

    def gather_center(self, center: Tensor, numels: list[int]) -> Tensor:
        """The rule's whole centre for a checkpoint (collective): each rank's is valid on its round-0 shard."""
        layout = self.layout(numels)
        return gather_shards(layout.take(center, comm.rank()), layout, tag="checkpoint")

    def gather_rows(self, rows: Tensor, out: Tensor) -> Tensor:
        """Every worker's rows (collective), in global worker order: a checkpoint's momentum. Returns ``out``, or
        ``rows`` themselves in one process; the Byzantine ranks mode's exchange gathers over its own transport."""
        return gather_rows(rows, out, tag="checkpoint")

    @staticmethod
    def _total(round_index: int, partial: Tensor) -> Tensor:
        """Round ``round_index``'s partial sums of every shard, all-gathered and added in shard order (rank ``q``
        holds shard ``q - round_index``), so that every rank and round adds the same numbers in the same order."""
        if comm.world_size() == 1:
            return partial
        gathered = comm.all_gather_stack(partial.contiguous(), tag="robust_totals")
        return gathered.roll(-round_index, dims=0).sum(dim=0)

    def _compare_digests(self, results: list[AggregationResult], layout: ColumnLayout) -> dict[int, bytes]:
        """The digests of every rank's round results, all-gathered and compared shard by shard; the agreed digest of
        each shard."""
        world = comm.world_size()
        mine = torch.tensor([list(digest(r.vector)) for r in results], dtype=torch.uint8)
        table = comm.all_gather_stack(mine.to(results[0].vector.device), tag="digests").cpu()  # (world, rounds, 16)
        agreed = {}
        for s in range(world):
            given = {q: bytes(table[q, j].tolist()) for j, q in enumerate(aggregating_ranks(s, world, self.replicas))}
            if len(set(given.values())) > 1:
                by_digest: dict[bytes, list[int]] = {}
                for q, d in given.items():
                    by_digest.setdefault(d, []).append(q)
                groups = "; ".join(f"ranks {qs} gave {d.hex()[:16]}" for d, qs in by_digest.items())
                raise AggregationMismatchError(
                    f"replicated aggregation: shard {s} (columns {_columns(layout, s)}) differs between the"
                    f" {self.replicas} ranks that aggregated it: {groups}. No rank applied this step"
                )
            agreed[s] = given[s]
        return agreed

    def _verify_gathered(self, vector: Tensor, agreed: dict[int, bytes], layout: ColumnLayout) -> None:
        """Each shard of the gathered aggregate is the one its aggregating ranks agreed on."""
        for s in range(layout.world_size):
            if digest(layout.take(vector, s)) != agreed[s]:
                raise AggregationMismatchError(
                    f"replicated aggregation: shard {s} (columns {_columns(layout, s)}) as all-gathered from rank {s}"
                    " is not the result its aggregating ranks agreed on. No rank applied this step"
                )
