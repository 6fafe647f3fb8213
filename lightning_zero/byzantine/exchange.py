"""The Byzantine ranks mode inside ``robust_ddp_scratch``: the engine's exchange ([Note: sharded aggregation] in
:mod:`lightning_zero.robust.shards`) replaced by :class:`~lightning_zero.byzantine.step.StepProtocol` over signed
point-to-point messages.

Runbook (what :class:`~lightning_zero.strategies.robust.RobustDDPStrategy` does with ``byzantine_ranks=f``)::

    engine.exchange = ByzantineExchange(f=1, timeout_s=10.0)   # before attach()
    metrics = engine.aggregate()     # each step: the protocol; every honest rank sets the same p.grad
    engine.exchange.last_outcome     # included ranks, proofs, silent ranks of the step
    engine.exchange.close()          # the fit's end: the connections closed

The transport is built at the first step, over the process group's rendezvous store (trusted by the threat model)
under a prefix counted per process, so that several fits in one process group never read each other's keys. Each of
this rank's ``2f + 1`` shards is aggregated by its own copy of the rule, every copy starting from the rule's
generator state; afterwards the rule keeps round 0's generator state and, for ``centered_clipping``, the agreed
aggregate as its centre (the same on every honest rank).
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import itertools
import logging
import os
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any

import torch
from torch import Tensor

from lightning_zero.byzantine import inputs
from lightning_zero.byzantine.behaviours import BEHAVIOURS, INPUT_BEHAVIOURS, Twisted, alie_rows, check_behaviour
from lightning_zero.byzantine.collectives import TolerantCollectives
from lightning_zero.byzantine.membership import Membership, check_f
from lightning_zero.byzantine.step import Outcome, StepProtocol
from lightning_zero.comm import collectives as comm
from lightning_zero.comm.signed import SignedTransport
from lightning_zero.robust.aggregation import AggregationResult, RobustAggregator
from lightning_zero.robust.shards import ColumnShard
from lightning_zero.robust.workers import WorkerGradients

log = logging.getLogger(__name__)
_RUNS = itertools.count()  # transports built by this process: the same sequence on every rank


class ByzantineExchange:
    """The engine's exchange in the Byzantine ranks mode (see the module docstring).

    Args:
        f: the Byzantine ranks tolerated (``n >= 3f + 1`` processes).
        timeout_s: each phase's deadline; a rank silent past it is left out of that step.
        behaviour: evaluation only: a name of :data:`~lightning_zero.byzantine.behaviours.BEHAVIOURS` that the
            ``behaving_ranks`` play (default: the last ``f``).
    """

    def __init__(
        self, f: int, timeout_s: float = 10.0, behaviour: str | None = None, behaving_ranks: list[int] | None = None
    ) -> None:
        self.f, self.timeout_s = f, float(timeout_s)
        self.behaviour, self.behaving_ranks = behaviour, behaving_ranks
        self.sink: Callable[[Tensor, set[str]], None] | None = None  # robust ZeRO's; refused with this mode
        self.step = 0
        self.last_outcome: Outcome | None = None
        self.members: Membership | None = None
        """The membership after the last step (kept after :meth:`close`)."""
        self.evictions: list[tuple[int, int, str]] = []
        """``(step, rank, why)`` of every eviction in this run."""
        self._transport: SignedTransport | None = None
        self._protocol: StepProtocol | None = None
        self._resumed: dict[str, Any] | None = None  # a checkpoint's state, until the protocol exists
        self._prefix, self._colluders = "", list[int]()  # the transport's store prefix; alie's ranks
        self.collectives = TolerantCollectives(self)
        """Lightning's collectives over the signed transport, while :attr:`running`."""

    @property
    def running(self) -> bool:
        """Whether the step protocol's transport is up (from the first step to :meth:`close`)."""
        return self._protocol is not None

    @property
    def replicas(self) -> int:
        return 2 * self.f + 1

    @property
    def received(self) -> list[Tensor]:
        return []

    @property
    def buffers(self) -> list[Tensor]:
        return []

    def reset(self, groups: list[list[int]] | None) -> None:
        """A new run: a new transport at its first step."""
        self.close()
        self.step, self._resumed = 0, None

    def state_dict(self) -> dict[str, Any]:
        """The step counter, the evictions so far and the protocol's state (membership, proofs): a checkpoint's."""
        state: dict[str, Any] = {"step": self.step, "evictions": list(self.evictions)}
        if self._protocol is not None:
            state["protocol"] = self._protocol.state_dict()
        elif self._resumed is not None and "protocol" in self._resumed:  # closed after the fit, or not started
            state["protocol"] = self._resumed["protocol"]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the step counter goes on, evicted ranks stay out (applied when the transport is built)."""
        self.step, self._resumed = int(state["step"]), dict(state)
        self.evictions = [(int(s), int(r), str(why)) for s, r, why in state["evictions"]]
        if self._protocol is not None and "protocol" in state:
            self._protocol.load_state_dict(state["protocol"])

    def send(self, grads: WorkerGradients, worker: int) -> None:
        """Nothing to start early: a step's messages go once every worker's rows are final."""

    def gather_center(self, center: Tensor, numels: list[int]) -> Tensor:
        """The rule's centre is the agreed aggregate, whole on every rank."""
        return center

    def gather_rows(self, rows: Tensor, out: Tensor) -> Tensor:
        """Every rank's worker rows for a checkpoint ([Note: tolerant collectives]; zeros for a rank gone)."""
        return out.copy_(self.collectives.gather_rows(rows))

    def _members(self) -> Membership:
        return Membership.of(comm.world_size(), self.f)

    def protocol(self) -> StepProtocol:
        if self._protocol is None:
            members = self._members()
            rank = comm.rank()
            transport = SignedTransport(
                rank, members.n, comm.rendezvous_store(), timeout_s=self.timeout_s,
                prefix=self._new_prefix(),
            )  # fmt: skip
            self._transport = transport
            atexit.register(transport.close)  # it outlives the fit's teardown ([Note: tolerant collectives])
            behaving = self.behaving_ranks if self.behaving_ranks is not None else list(members.members[-self.f :])
            self._colluders = sorted(set(behaving)) if self.behaviour in INPUT_BEHAVIOURS else []
            link: Any = transport
            timeout = self.timeout_s
            if self.behaviour is not None and rank in behaving:
                link = Twisted(transport, BEHAVIOURS[self.behaviour](members, self.timeout_s), crash=_exit)
                # The faulty rank's own (honest) code must trail the honest ranks, which wait for it, rather than
                # give up on them first and fail its process (a crash is a behaviour of its own).
                timeout *= 4
            self._protocol = StepProtocol(link, members, timeout_s=timeout)
            if self._resumed is not None and "protocol" in self._resumed:
                self._protocol.load_state_dict(self._resumed["protocol"])
        return self._protocol

    def aggregate(
        self, grads: WorkerGradients, aggregator: RobustAggregator, unused: AbstractSet[str] = frozenset()
    ) -> tuple[AggregationResult, Tensor]:
        """One step of the protocol on this rank's rows; the aggregate (on the rows' device) and round 0's result.

        A rank the protocol evicted takes no more part: it keeps Lightning's loop going (whose own collectives still
        include it) with a zero aggregate, and its weights are no longer the job's."""
        protocol = self.protocol()
        rows = grads.vectors()
        self.step += 1
        if comm.rank() not in protocol.membership.members:
            self.last_outcome = None
            zero = rows.new_zeros(rows.shape[1])
            return AggregationResult(zero, float("nan"), None, 0, 0.0), zero
        rounds = [copy.deepcopy(aggregator) for _ in protocol.membership.shards_of(comm.rank())]
        results: dict[int, AggregationResult] = {}

        def aggregate(j: int, stack: Tensor, shard: ColumnShard) -> Tensor:
            results[j] = rounds[j](stack, shard)
            return results[j].vector

        sent = rows.detach().cpu()
        if comm.rank() in self._colluders:
            sent = self._collude(sent)
        outcome = protocol.run(self.step - 1, sent, aggregate)
        self.last_outcome, self.members = outcome, protocol.membership
        for rank in outcome.evicted:
            proof = outcome.proofs.get(rank)
            why = f"proof: {proof.kind}" if proof is not None else f"left out {protocol.evict_after} steps in a row"
            self.evictions.append((self.step - 1, rank, why))
            log.warning(f"lightning_zero: rank {rank} evicted after step {self.step - 1} ({why})")
        aggregator.generator.set_state(rounds[0].generator.get_state())
        vector = outcome.vector.to(rows.device)
        if aggregator.spec.stateful:
            aggregator.center = vector.detach().clone()
        first = results.get(0)
        if first is None:  # this rank aggregated no shard of its own in time: the metrics say so
            return AggregationResult(vector, float("nan"), None, 0, 0.0), vector
        seconds = sum(r.seconds for r in results.values())
        return dataclasses.replace(first, vector=vector, seconds=seconds), vector

    def _new_prefix(self) -> str:
        self._prefix = f"lightning_zero/byzantine/{next(_RUNS)}"
        return self._prefix

    def _collude(self, rows: Tensor) -> Tensor:
        """``alie``: this colluder's rows pooled with the others' through the store; the rows it commits to."""
        store, me, key = comm.rendezvous_store(), comm.rank(), f"{self._prefix}/alie/{self.step}"
        store.set(f"{key}/{me}", inputs.piece_bytes(rows))
        pool = [  # in rank order on every colluder: they all commit to the same bits
            rows if rank == me else inputs.piece_tensor(store.get(f"{key}/{rank}"), rows.shape[0], rows.dtype)
            for rank in self._colluders
        ]
        if self.step > 2:  # every colluder read it before its step's protocol, which ended before this one began
            store.delete_key(f"{self._prefix}/alie/{self.step - 2}/{me}")
        return alie_rows(torch.cat(pool), rows.shape[0])

    def metrics(self) -> dict[str, float]:
        """The last step's ``byzantine/members`` (after it), ``byzantine/left_out`` (members whose rows it did not
        use), ``byzantine/proofs`` (ranks proven faulty by this rank in it), ``byzantine/silent`` (ranks that missed
        a deadline) and, at a step that evicts, ``byzantine/evicted_rank`` (the lowest evicted; the proof's kind is
        in the log)."""
        outcome, members = self.last_outcome, self.members
        if outcome is None or members is None:
            return {}
        out = {
            "byzantine/members": float(members.n),
            "byzantine/left_out": float(members.n + len(outcome.evicted) - len(outcome.included)),
            "byzantine/proofs": float(len(outcome.proofs)),
            "byzantine/silent": float(len(outcome.silent)),
        }
        if outcome.evicted:
            out["byzantine/evicted_rank"] = float(min(outcome.evicted))
        out.update({f"byzantine/{phase}_ms": seconds * 1e3 for phase, seconds in outcome.seconds.items()})
        return out

    def close(self) -> None:
        """The connections closed; the protocol's state is kept for a checkpoint saved after the fit."""
        if self._protocol is not None:
            self._resumed = {**(self._resumed or {}), "protocol": self._protocol.state_dict()}
        if self._transport is not None:
            self._transport.close()
        self._transport, self._protocol = None, None


def _exit(why: str) -> None:
    """The ``crash`` behaviour in a fit: the process ends where it stands, no teardown, no word to anyone."""
    log.warning(f"lightning_zero: {why}")
    os._exit(CRASH_EXIT)


CRASH_EXIT = 75
"""The exit status of a rank that played ``crash``."""


def check_settings(
    byzantine_ranks: Any, byzantine_timeout: Any = 10.0, aggregator: str = "median", aggregation_replicas: int = 1,
    byzantine_rank_behaviour: Any = None, byzantine_behaving_ranks: Any = None, world_size: int | None = None,
    workers_per_rank: int = 1,
) -> None:  # fmt: skip
    """The Byzantine ranks settings of ``robust_ddp_scratch`` (``None``: the world size is not known yet), each bad
    one or bad combination refused naming the numbers."""
    if byzantine_ranks == 0 and not isinstance(byzantine_ranks, bool):
        if byzantine_rank_behaviour is not None:
            raise ValueError(f"byzantine_rank_behaviour={byzantine_rank_behaviour!r} needs byzantine_ranks >= 1")
        return
    check_f(byzantine_ranks, world_size)
    if isinstance(byzantine_timeout, bool) or not isinstance(byzantine_timeout, (int, float)) or byzantine_timeout <= 0:
        raise ValueError(f"byzantine_timeout={byzantine_timeout!r} is invalid: expected a number of seconds > 0")
    if aggregator == "mean":
        raise ValueError(
            "byzantine_ranks needs a robust rule: a rank left out of a step sends NaN rows, which every rule but"
            " aggregator='mean' drops"
        )
    if aggregation_replicas != 1:
        raise ValueError(
            f"aggregation_replicas={aggregation_replicas} with byzantine_ranks={byzantine_ranks}: the mode aggregates"
            f" each shard on 2f + 1 = {2 * byzantine_ranks + 1} ranks itself; leave aggregation_replicas=1"
        )
    check_behaviour(byzantine_rank_behaviour, byzantine_behaving_ranks, world_size, byzantine_ranks, workers_per_rank)
