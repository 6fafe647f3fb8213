"""Faulty ranks for evaluating the Byzantine ranks mode: real attack code in a real process, written as rewrites of
what the rank sends (``byzantine_rank_behaviour=`` on the ranks ``byzantine_behaving_ranks=``).

Runbook::

    transport = Twisted(SignedTransport(...), BEHAVIOURS["equivocate"](members))   # this rank now lies
    StepProtocol(transport, members).run(step, rows, aggregate)                     # the honest code, twisted

Each behaviour keeps the rank's honest code and changes its messages on the wire, so that the proofs the honest
ranks build are about messages the rank really signed:

- ``silent``: sends nothing (a rank whose process lives but stays mute);
- ``equivocate``: to every peer but its first, shard columns scaled by -5 under a second signed commitment;
- ``forged_digest``: to its first peer, zeroed columns under its true commitment;
- ``wrong_aggregate``: zeroed shard results; ``wrong_partial``: zeroed partial sums of the totals;
- ``wrong_vote``: agreement votes for a value no one proposed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_zero.byzantine import inputs, wire
from lightning_zero.byzantine.agreement import COMMIT, PHASE_BASE, PREPARE, view_phase
from lightning_zero.byzantine.inputs import COMMITMENT, INPUT
from lightning_zero.byzantine.membership import Membership
from lightning_zero.byzantine.step import RESULT
from lightning_zero.byzantine.totals import TOTALS

Rewrite = Callable[["Twisted", int, int, int, bytes], "bytes | None"]
"""``(link, peer, step, phase, payload) -> what is sent instead`` (``None``: nothing)."""


class Twisted:
    """A faulty rank's transport: ``rewrite`` replaces what it sends; ``sign_own`` signs what it forges."""

    def __init__(self, inner: Any, rewrite: Rewrite) -> None:
        self.inner, self.rewrite = inner, rewrite

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def send(self, peer: int, step: int, phase: int, payload: bytes, tag: str = "") -> None:
        out = self.rewrite(self, peer, step, phase, payload)
        if out is not None:
            self.inner.send(peer, step, phase, out, tag=tag)


def _silent(members: Membership) -> Rewrite:
    return lambda link, peer, step, phase, payload: None


def _first_peer(members: Membership, rank: int) -> int:
    return next(r for r in members.members if r != rank)


def _equivocate(members: Membership) -> Rewrite:
    def rewrite(link: Twisted, peer: int, step: int, phase: int, payload: bytes) -> bytes | None:
        if phase != INPUT or peer == _first_peer(members, link.rank):
            return payload
        commitment, _, *pieces = wire.unpack(payload)
        parts = wire.unpack(commitment)
        dtype = getattr(torch, parts[2].decode().removeprefix("torch."))
        rows = wire.unpack_int(parts[1])
        twisted = [inputs.piece_bytes(inputs.piece_tensor(p, rows, dtype) * -5) for p in pieces]
        digests = list(parts[3:])
        for shard, piece in zip(members.shards_of(peer), twisted):
            digests[shard] = wire.sha256(piece)
        other = wire.pack([*parts[:3], *digests])
        return inputs.input_frame(other, link.sign_own(step, COMMITMENT, other), twisted)

    return rewrite


def _forged_digest(members: Membership) -> Rewrite:
    def rewrite(link: Twisted, peer: int, step: int, phase: int, payload: bytes) -> bytes | None:
        if phase != INPUT or peer != _first_peer(members, link.rank):
            return payload
        commitment, claim, *pieces = wire.unpack(payload)
        return wire.pack([commitment, claim, *(bytes(len(p)) for p in pieces)])

    return rewrite


def _zeroed_values(phases: Callable[[int], bool]) -> Callable[[Membership], Rewrite]:
    def make(members: Membership) -> Rewrite:
        def rewrite(link: Twisted, peer: int, step: int, phase: int, payload: bytes) -> bytes | None:
            if not phases(phase):
                return payload
            values = wire.unpack_shard_values(payload)
            return wire.pack_shard_values({shard: bytes(len(value)) for shard, value in values.items()})

        return rewrite

    return make


def _wrong_vote(members: Membership) -> Rewrite:
    votes = {view_phase(v, k) for v in range(members.n) for k in (PREPARE, COMMIT)}
    return lambda link, peer, step, phase, payload: wire.sha256(b"no one proposed this") if phase in votes else payload


BEHAVIOURS: dict[str, Callable[[Membership], Rewrite]] = {
    "silent": _silent,
    "equivocate": _equivocate,
    "forged_digest": _forged_digest,
    "wrong_aggregate": _zeroed_values(lambda phase: phase == RESULT),
    "wrong_partial": _zeroed_values(lambda phase: TOTALS <= phase < PHASE_BASE),
    "wrong_vote": _wrong_vote,
}
"""The behaviours by name; each makes the rewrite of a rank of ``members``."""


def check_behaviour(behaviour: object, ranks: object, world_size: int | None = None) -> None:
    """``byzantine_rank_behaviour`` is ``None`` or a name of :data:`BEHAVIOURS`; ``byzantine_behaving_ranks`` ranks of
    the job (``None``: the world size is not known yet)."""
    if behaviour is not None and behaviour not in BEHAVIOURS:
        raise ValueError(
            f"byzantine_rank_behaviour={behaviour!r} is invalid: expected None or one of {list(BEHAVIOURS)}"
        )
    if ranks is not None:
        if not isinstance(ranks, (list, tuple)) or not all(isinstance(r, int) and r >= 0 for r in ranks):
            raise ValueError(f"byzantine_behaving_ranks={ranks!r} is invalid: expected a list of ranks")
        if world_size is not None and any(r >= world_size for r in ranks):
            raise ValueError(f"byzantine_behaving_ranks={list(ranks)} is invalid for {world_size} processes")
