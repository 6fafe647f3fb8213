"""The rules' totals in the Byzantine ranks mode: a member's rounds run in lockstep and meet at each call of
``total``, whose per-shard partial sums are then replicated like the results ([Note: Byzantine totals] in
:mod:`lightning_zero.byzantine.step`).

Runbook (inside :meth:`lightning_zero.byzantine.step.StepProtocol.run`)::

    totals = Lockstep(protocol, step, rounds=2 * f + 1, proofs=proofs, incomplete=set())
    shard = ColumnShard(..., total=functools.partial(totals.total, j))   # round j's, in its own thread
    accepted = replicated(protocol, step, RESULT, mine, "byzantine_results", proofs, "result")   # the results too

:func:`replicated` is the exchange both share: per-shard values signed by their aggregators, each shard's accepted
where ``f + 1`` of them agree.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import Tensor

from lightning_zero.byzantine import inputs, wire
from lightning_zero.byzantine.inputs import Proof
from lightning_zero.comm.signed import Evidence

TOTALS = 16
"""The transport phase of the first call of ``total`` in a step (the ``t``-th: ``TOTALS + t``)."""


class Lockstep:
    """The shared ``total`` of one member's rounds ([Note: Byzantine totals])."""

    def __init__(self, protocol: Any, step: int, rounds: int, proofs: dict[int, Proof], incomplete: set[int]) -> None:
        self.protocol, self.step, self.proofs, self.incomplete = protocol, step, proofs, incomplete
        self.calls = 0
        self.error: BaseException | None = None
        self._partials: list[Tensor | None] = [None] * rounds
        self._result: Tensor | None = None
        self._barrier = threading.Barrier(rounds, action=self._exchange, timeout=protocol.timeout_s * 4)
        self._shards = protocol.membership.shards_of(protocol.me)

    def abort(self) -> None:
        self._barrier.abort()

    def total(self, j: int, partial: Tensor) -> Tensor:
        """Round ``j``'s partial sums -> the totals over every shard (when every round has handed its own)."""
        self._partials[j] = partial
        self._barrier.wait()
        assert self._result is not None
        return self._result.clone()

    def _exchange(self) -> None:
        try:
            partials = [p for p in self._partials if p is not None]
            like = partials[0]
            mine = {
                s: inputs.piece_bytes(p.reshape(1, -1))
                for s, p in zip(self._shards, partials)
                if s not in self.incomplete
            }
            phase = TOTALS + self.calls
            self.calls += 1
            accepted = replicated(self.protocol, self.step, phase, mine, "byzantine_totals", self.proofs, "partial sum")
            total = torch.zeros_like(like)
            for shard in range(self.protocol.membership.n):
                total += inputs.piece_tensor(accepted[shard], 1, like.dtype).reshape(like.shape)
            self._result = total
        except BaseException as err:
            self.error = err
            raise


class StepFailed(RuntimeError):
    """A shard's result or partial sum did not gather ``f + 1`` identical signed copies within the timeout: more
    faulty members than ``f`` among its aggregators, or messages slower than the timeout. Raised before the step is
    applied."""


def _values(protocol: Any, got: dict[int, tuple[bytes, Evidence]]) -> dict[int, dict[int, bytes]]:
    """``{shard: {aggregator: value}}`` of per-shard messages (a part that does not parse is skipped)."""
    values: dict[int, dict[int, bytes]] = {}
    for sender, (data, _) in got.items():
        try:
            sent = wire.unpack_shard_values(data)
        except ValueError:
            continue
        for shard, value in sent.items():
            if 0 <= shard < protocol.membership.n and sender in protocol.membership.aggregators(shard):
                values.setdefault(shard, {})[sender] = value
    return values


def _settled(protocol: Any, got: dict[int, tuple[bytes, Evidence]]) -> bool:
    """Whether every shard has a value that ``f + 1`` of its aggregators sent."""
    values, need = _values(protocol, got), protocol.membership.acceptance
    for shard in range(protocol.membership.n):
        counts: dict[bytes, int] = {}
        for value in values.get(shard, {}).values():
            counts[value] = counts.get(value, 0) + 1
        if not counts or max(counts.values()) < need:
            return False
    return True


def replicated(
    protocol: Any, step: int, phase: int, mine: dict[int, bytes], tag: str, proofs: dict[int, Proof], what: str
) -> dict[int, bytes]:
    """Send ``protocol``'s member's per-shard values, and return each shard's value as ``f + 1`` of its aggregators
    signed it; an aggregator that signed another value is proven faulty (``wrong_aggregate``)."""
    members, me = protocol.membership, protocol.me
    payload = wire.pack_shard_values(mine)
    for peer in protocol.peers:
        protocol.send(peer, step, phase, payload, tag)
    own = {me: (payload, protocol.transport.sign_own(step, phase, payload))}
    got = {
        **own,
        **protocol.collect(step, phase, set(protocol.peers), lambda more: _settled(protocol, {**own, **more})),
    }
    values = _values(protocol, got)
    accepted = {}
    for shard in range(members.n):
        counts: dict[bytes, list[int]] = {}
        for sender, value in values.get(shard, {}).items():
            counts.setdefault(value, []).append(sender)
        agreed = [v for v, senders in counts.items() if len(senders) >= members.acceptance]
        if not agreed:
            raise StepFailed(
                f"lightning_zero: rank {me}, step {step}: no {what} of shard {shard} was signed identically by"
                f" f + 1 = {members.acceptance} of its aggregators {list(members.aggregators(shard))}"
                f" ({sum(map(len, counts.values()))} answered in {protocol.timeout_s:g} s)"
            )
        accepted[shard] = agreed[0]
        witnesses = tuple(got[s] for s in counts[agreed[0]][: members.acceptance])
        for value, senders in counts.items():
            for sender in senders:
                if value != agreed[0] and sender not in proofs:
                    detail = f"rank {sender} signed a {what} of shard {shard} that differs from the accepted one"
                    proofs[sender] = Proof(sender, "wrong_aggregate", detail, (got[sender], *witnesses))
    return accepted
