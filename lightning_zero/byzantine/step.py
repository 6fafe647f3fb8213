"""One training step of the Byzantine ranks mode: committed inputs, echo, agreement on the input set, recovery of
missing columns, aggregation of each shard by ``2f + 1`` members, and the shard results that ``f + 1`` of them
signed identically.

Runbook::

    protocol = StepProtocol(transport, Membership.of(4, f=1), timeout_s=10.0)
    outcome = protocol.run(step, rows, aggregate)   # rows: this member's (k, d) worker rows
    outcome.vector                                  # the aggregate: the same bits on every honest member
    outcome.included, outcome.proofs, outcome.silent

``aggregate(round, stack, shard)`` aggregates ``stack`` (``(N k, w)``: every rank's rows of ``shard``'s columns, in
rank order, the rows of a rank left out of the step or evicted NaN, which the robust rules drop as non-finite, so
that the rule's ``n`` stays the job's) and returns the shard's ``(w,)`` result; the ``2f + 1`` rounds (one per shard
this member aggregates) run side by side in threads, and ``shard.total`` is shared by them ([Note: Byzantine
totals]).

[Note: Byzantine totals] Rules that sum over every coordinate (the non-finite filter, Krum's distances, centered
clipping's norms) add per-shard partial sums ([Note: sharded aggregation] in :mod:`lightning_zero.robust.shards`).
A faulty aggregator could bend every member's totals through its partial, so here every partial is replicated like
the results: the ``2f + 1`` rounds of a member run in lockstep, their ``t``-th call of ``total`` meets at a barrier,
the member sends all its shards' ``t``-th partials (signed) to every member, and each shard's partial is the one
``f + 1`` of its aggregators sent identically. Every member adds the accepted partials in shard order: the same
totals, bit for bit, everywhere. The rounds of one rule make the same sequence of ``total`` calls because its
control flow depends on the totals only, never on one shard's columns.

Phases, each waiting for every member until the end of its round ([Note: rounds]; a member that sends nothing in
time is *silent* for the rest of the step, so that it costs one timeout, not one per phase; where ``f + 1`` agreeing
copies of a result are short without it, it gets one more round): inputs and echo ([Note: committed inputs] in
:mod:`lightning_zero.byzantine.inputs`; the echo also spreads proofs), the agreement
(:mod:`lightning_zero.byzantine.agreement`) on the inputs and on evictions ([Note: eviction] in
:mod:`lightning_zero.byzantine.proofs`), a request round for columns an included member did not send here
(:mod:`lightning_zero.byzantine.recovery`), the totals, the results. A member that could not recover an included
member's columns of a shard signs no partial sum or result of it: it would be proven wrong.

[Note: rounds] An honest member can be late by a whole timeout: it waited that long for a silent member in the
previous phase. Were each phase's deadline ``timeout_s`` after the waiter's own start, a late honest member's message
would race that deadline, lose it about one time in three, be taken for silent, and miss its requests and results
(the step then fails on every member). So the phases run in rounds on a schedule: round ``i`` of a member ends
``timeout_s`` after round ``i - 1`` ended on the schedule (or after now, if later), the schedule starting with the step
and again when the agreement decides (which the honest members leave together). A member that finishes a round late
still finishes it by the schedule, and the others wait for its next message until the end of the next round: a whole
``timeout_s`` past the earliest it could send. Every honest member runs the same rounds (a phase with a second chance
always takes two, the request round for pieces always runs, asked for or not), so the schedules agree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_zero.byzantine import inputs
from lightning_zero.byzantine import proofs as travelling
from lightning_zero.byzantine.agreement import Agreement, Decision
from lightning_zero.byzantine.inputs import ECHO, INPUT, Commitment, Held, Proof, Proposal
from lightning_zero.byzantine.membership import Membership
from lightning_zero.byzantine.recovery import recover
from lightning_zero.byzantine.totals import Lockstep, replicated
from lightning_zero.comm.signed import Evidence, PeerGone, PeerTimeout
from lightning_zero.robust.shards import ColumnLayout, ColumnShard

RESULT = 5
"""The transport phase of the results (1 to 4: inputs, echo, requests, pieces; from 16: the totals)."""

Aggregate = Callable[[int, Tensor, ColumnShard], Tensor]


class _Clock:
    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name], self._last = now - self._last, now


@dataclasses.dataclass
class Outcome:
    """What a step decided: the aggregate, whose inputs it holds, what was proven and who stayed silent."""

    vector: Tensor
    included: tuple[int, ...]
    proofs: dict[int, Proof]
    silent: set[int]
    decision: Decision
    evicted: tuple[int, ...] = ()
    """The ranks that leave after this step (proven, or left out ``evict_after`` steps in a row)."""
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    """Wall time by phase: ``inputs`` (commit, send, receive, check), ``echo``, ``agreement``, ``recovery`` and
    ``aggregation`` (the rounds with their totals, and the results)."""


class StepProtocol:
    """The step protocol of one member (see the module docstring).

    Args:
        transport: this member's :class:`~lightning_zero.comm.signed.SignedTransport`.
        membership: the members and ``f``.
        timeout_s: each phase's deadline, and the agreement's first view's.
    """

    def __init__(
        self, transport: Any, membership: Membership, *, timeout_s: float = 10.0, evict_after: int | None = None
    ) -> None:
        self.transport, self.membership, self.timeout_s = transport, membership, float(timeout_s)
        self.evict_after = membership.f + 1 if evict_after is None else int(evict_after)
        if self.evict_after < membership.f + 1:
            raise ValueError(
                f"evict_after={evict_after} is invalid for f={membership.f}: expected >= f + 1 = {membership.f + 1}"
                " (fewer steps in a row could all be led by faulty ranks that leave an honest one out)"
            )
        self.me = transport.rank
        self.agreement = Agreement(transport, membership, timeout_s=timeout_s)
        self._silent: set[int] = set()  # the members that missed a deadline of the running step
        self._schedule = time.monotonic()  # the end of the last round on the schedule ([Note: rounds])
        self._history: dict[int, Membership] = {}  # the membership of each step run (proofs are checked by it)
        self._spread: dict[int, Proof] = {}  # the travelling proofs held against members still in
        self._left_out: dict[int, int] = {}  # steps in a row each member was left out of

    @property
    def peers(self) -> list[int]:
        return [r for r in self.membership.members if r != self.me]

    def send(self, peer: int, step: int, phase: int, payload: bytes, tag: str) -> None:
        with contextlib.suppress(PeerGone, PeerTimeout):  # its silence shows in what it fails to send back
            self.transport.send(peer, step, phase, payload, tag=tag)

    def collect(
        self, step: int, phase: int, want: set[int], enough: Callable[[dict[int, Any]], bool] | None = None
    ) -> dict[int, tuple[bytes, Evidence]]:
        """The ``phase`` messages of the members in ``want``, waiting for all of them until the end of the next
        round ([Note: rounds]). A member that misses it is silent for the rest of the step: no later phase waits for
        it (one timeout per step, not one per phase). ``enough(got)``: when what came from the others does not
        satisfy it, the silent members get one more round (honest members that waited for different members drift
        apart); the round is on the schedule whether it is used or not."""
        got = self._gather(step, phase, want - self._silent, {}, self._round())
        if enough is not None:
            second = self._round()
            if not enough(got):
                got = self._gather(step, phase, want & self._silent, got, second, enough)
        self._silent |= want - got.keys()
        return got

    def _round(self) -> float:
        """The end of this member's next round: ``timeout_s`` after the last one's, and at least after now."""
        self._schedule = max(self._schedule, time.monotonic()) + self.timeout_s
        return self._schedule

    def _gather(
        self, step: int, phase: int, want: set[int], got: dict[int, tuple[bytes, Evidence]], deadline: float,
        enough: Callable[[dict[int, Any]], bool] | None = None,
    ) -> dict[int, tuple[bytes, Evidence]]:  # fmt: skip
        got = dict(got)
        want = want | got.keys()
        while not want <= got.keys() and time.monotonic() < deadline and not (enough is not None and enough(got)):
            for sender, _, payload, evidence in self.transport.take(
                step, range(phase, phase + 1), deadline - time.monotonic()
            ):
                if sender in want:
                    got.setdefault(sender, (payload, evidence))
        return got

    def state_dict(self) -> dict[str, Any]:
        """The membership, the left-out streaks and the proofs still to spread (with the memberships of their
        steps): what a resume needs to keep evicted ranks out and to go on proving."""
        steps = {travelling.step_of(p) for p in self._spread.values()}
        return {
            "members": list(self.membership.members), "f": self.membership.f, "left_out": dict(self._left_out),
            "spread": [travelling.encode(p) for p in self._spread.values()],
            "history": {s: (list(m.members), m.f) for s, m in self._history.items() if s in steps},
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.membership = self.agreement.membership = Membership(tuple(state["members"]), state["f"])
        self._left_out = dict(state["left_out"])
        self._history = {int(s): Membership(tuple(m), f) for s, (m, f) in state["history"].items()}
        self._spread = {p.rank: p for p in map(travelling.decode, state["spread"])}

    # ------------------------------------------------------------------------------------------------ the step
    def run(self, step: int, rows: Tensor, aggregate: Aggregate) -> Outcome:
        """One step with this member's ``(k, d)`` ``rows`` (see the module docstring)."""
        members, me, keys = self.membership, self.me, self.transport.public_keys
        self._history[step] = members
        clock = _Clock()
        commit, pieces = Commitment.of(rows, members)
        encoded = commit.encode()
        claim = self.transport.sign_own(step, inputs.COMMITMENT, encoded)
        for peer in self.peers:
            frame = inputs.input_frame(encoded, claim, [pieces[c] for c in members.shards_of(peer)])
            self.send(peer, step, INPUT, frame, "byzantine_inputs")
        held: dict[int, Held] = {me: Held(encoded, claim, {c: pieces[c] for c in members.shards_of(me)})}
        signed: dict[int, tuple[bytes, Evidence]] = {me: (encoded, claim)}
        proofs: dict[int, Proof] = {}
        self._silent, self._schedule = set(), time.monotonic()
        self.transport.forget_before(step)
        for sender, (payload, evidence) in self.collect(step, INPUT, set(self.peers)).items():
            try:
                held[sender] = inputs.check_input(payload, sender, step, me, keys, members, commit)
                signed[sender] = (held[sender].commitment, held[sender].claim)
            except ValueError as err:
                proofs[sender] = Proof(sender, _kind(err), str(err), ((payload, evidence),))
        self._spread.update({r: p for r, p in proofs.items() if p.kind in travelling.SPREAD})
        clock.lap("inputs")
        echoes = self._echo(step, held, signed, proofs, commit)
        clock.lap("echo")
        # agreement on the inputs and on who leaves

        def propose() -> bytes:
            evictions = {r: travelling.encode(p) for r, p in self._spread.items() if r in members.members}
            return inputs.choose(signed, echoes, proofs, step, keys, members, evictions).encode(members)

        decision = self.agreement.decide(step, propose, lambda value: self._why_not(value, step, proofs, commit))
        proposal = inputs.check_proposal(decision.value, step, keys, members, {}, lambda r, p: None)
        self._schedule = time.monotonic()  # the honest members leave the agreement together ([Note: rounds])
        clock.lap("agreement")
        recover(self, step, proposal, held, commit)
        clock.lap("recovery")
        vector = self._aggregate(step, proposal, held, commit, rows, aggregate, proofs)
        clock.lap("aggregation")
        self._spread.update({r: p for r, p in proofs.items() if p.kind in travelling.SPREAD})  # wrong results too
        evicted = self._leave(proposal)
        outcome = Outcome(vector, tuple(sorted(proposal.included)), proofs, set(self._silent), decision, evicted)
        outcome.seconds = clock.laps
        return outcome

    def _echo(
        self, step: int, held: dict[int, Held], signed: dict[int, tuple[bytes, Evidence]], proofs: dict[int, Proof],
        commit: Commitment,
    ) -> dict[int, tuple[bytes, Evidence]]:  # fmt: skip
        """The echo round: every signed commitment held, and the proofs to spread, to every member; the echoes
        received (own included), the equivocations they reveal and the proofs they carry added to ``proofs``."""
        members, me, keys = self.membership, self.me, self.transport.public_keys
        spread = [travelling.encode(p) for r, p in sorted(self._spread.items()) if r in members.members]
        echo = inputs.echo_payload(held, signed, members, spread)
        echoes = {me: (echo, self.transport.sign_own(step, ECHO, echo))}
        for peer in self.peers:
            self.send(peer, step, ECHO, echo, "byzantine_echo")
        for sender, (payload, evidence) in self.collect(step, ECHO, set(self.peers)).items():
            try:
                entries, carried = inputs.read_echo(payload, step, keys, members)
            except ValueError as err:
                proofs.setdefault(sender, Proof(sender, "malformed", str(err), ((payload, evidence),)))
                continue
            echoes[sender] = (payload, evidence)
            for rank, (commitment, entry_claim, _) in entries.items():
                mine = signed.setdefault(rank, (commitment, entry_claim))
                proof = inputs.equivocation(rank, mine, (commitment, entry_claim))
                if proof is not None:
                    proofs.setdefault(rank, proof)
                    self._spread.setdefault(rank, proof)
            for data in carried:
                try:
                    proof = travelling.decode(data)
                except ValueError:
                    continue
                if self._check_proof(proof, commit) is None:
                    proofs.setdefault(proof.rank, proof)
                    self._spread.setdefault(proof.rank, proof)
        return echoes

    def _check_proof(self, proof: Proof, commit: Commitment) -> str | None:
        members = self._history.get(travelling.step_of(proof))
        if members is None or proof.rank not in self.membership.members:
            return f"a proof against rank {proof.rank} of a step this member does not know, or not a member now"
        return travelling.check(proof, self.transport.public_keys, members, commit)

    def _why_not(self, value: bytes, step: int, proofs: dict[int, Proof], commit: Commitment) -> str | None:
        """Why this member does not vote for the proposal ``value``, or ``None``."""

        def eviction(rank: int, data: bytes) -> str | None:
            try:
                proof = travelling.decode(data)
            except ValueError as err:
                return str(err)
            return self._check_proof(proof, commit) if proof.rank == rank else "a proof against another rank"

        try:
            inputs.check_proposal(value, step, self.transport.public_keys, self.membership, proofs, eviction)
        except ValueError as err:
            return str(err)
        return None

    def _leave(self, proposal: Proposal) -> tuple[int, ...]:
        """The members the decided proposal evicts, and those left out ``evict_after`` steps in a row ([Note:
        eviction]), gone from the membership of the next step."""
        members = self.membership
        for rank in members.members:
            left_out = rank not in proposal.included and rank not in proposal.evicted
            self._left_out[rank] = self._left_out.get(rank, 0) + 1 if left_out else 0
        leaving = set(proposal.evicted) | {r for r, n in self._left_out.items() if n >= self.evict_after}
        for rank in sorted(leaving & set(members.members)):
            members = members.without(rank)
            self._spread.pop(rank, None)
            self._left_out.pop(rank, None)
        self.membership = self.agreement.membership = members
        # Keep the memberships a proof may still be checked against: this step's (its proofs travel in the next
        # echo) and those of the proofs still spread; not one per step of the run.
        keep = {max(self._history)} | {travelling.step_of(p) for p in self._spread.values()}
        self._history = {s: m for s, m in self._history.items() if s in keep}
        return tuple(sorted(leaving))

    # ------------------------------------------------------------------------------------------------ aggregation
    def _aggregate(
        self, step: int, proposal: Proposal, held: dict[int, Held], commit: Commitment, rows: Tensor,
        aggregate: Aggregate, proofs: dict[int, Proof],
    ) -> Tensor:  # fmt: skip
        members, me = self.membership, self.me
        layout = ColumnLayout.contiguous(commit.width, members.n)
        shards = members.shards_of(me)
        k, dtype = commit.rows, rows.dtype
        stacks, incomplete = [], set()
        for shard in shards:
            parts = []
            for rank in range(self.transport.world_size):  # every rank of the job: the rule's n stays the same
                piece = held[rank].pieces.get(shard) if rank in proposal.included and rank in held else None
                if piece is None:
                    parts.append(torch.full((k, layout.size(shard)), float("nan"), dtype=dtype))
                    if rank in proposal.included:  # columns this member could not recover: it signs nothing of it
                        incomplete.add(shard)
                else:
                    parts.append(inputs.piece_tensor(piece, k, dtype))
            stacks.append(torch.cat(parts))
        totals = Lockstep(self, step, len(shards), proofs, incomplete)
        results: list[Tensor | None] = [None] * len(shards)
        errors: list[BaseException] = []

        def round_(j: int) -> None:
            try:
                total = functools.partial(totals.total, j)
                shard = ColumnShard(shards[j], layout.shards[shards[j]], commit.width, total=total)
                results[j] = aggregate(j, stacks[j], shard)
            except BaseException as err:  # re-raised by the caller
                errors.append(err)
                totals.abort()

        threads = [threading.Thread(target=round_, args=(j,), name=f"byzantine-round-{j}") for j in range(len(shards))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if totals.error is not None:
            raise totals.error
        if errors:
            raise errors[0]
        mine = {
            s: inputs.piece_bytes(r.reshape(1, -1))
            for s, r in zip(shards, results)
            if r is not None and s not in incomplete
        }
        accepted = replicated(self, step, RESULT, mine, "byzantine_results", proofs, "result")
        vector = rows.new_empty(commit.width)
        for shard, data in accepted.items():
            layout.put(vector, shard, inputs.piece_tensor(data, 1, dtype)[0])
        return vector


def _kind(err: ValueError) -> str:
    return "forged_digest" if "forged digest" in str(err) else "malformed"
