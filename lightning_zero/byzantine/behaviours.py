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
- ``wrong_vote``: agreement votes for a value no one proposed;
- ``slow_under``, ``slow_over``: each step's first message sent 0.8 or 1.25 timeouts late (a straggler just inside
  the deadline, which the others wait for, and one just past it, left out and then evicted);
- ``crash``: the rank's connections closed at step 1, as a process that died would leave them (in a fit, the
  process exits);
- ``alie``: the behaving ranks collude in "a little is enough" (Baruch et al., 2019). They pool the rows their
  workers honestly computed (through the rendezvous store, a channel of their own) and each commits to
  ``mean - ALIE_Z x std`` of the pool, coordinate-wise, in every worker row, then plays the protocol honestly. Nothing
  on the wire is provable: the robust rule alone bounds what it does. It changes the rows, not the messages
  (:func:`alie_rows`, applied by the exchange before the step).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_zero.byzantine import inputs, wire
from lightning_zero.byzantine.agreement import COMMIT, PHASE_BASE, PREPARE, view_phase
from lightning_zero.byzantine.inputs import COMMITMENT, INPUT
from lightning_zero.byzantine.membership import Membership
from lightning_zero.byzantine.step import RESULT
from lightning_zero.byzantine.totals import TOTALS
from lightning_zero.robust.attacks import alie_row

Rewrite = Callable[["Twisted", int, int, int, bytes], "bytes | None"]
"""``(link, peer, step, phase, payload) -> what is sent instead`` (``None``: nothing)."""
Behaviour = Callable[[Membership, float], Rewrite]
"""``(members, timeout_s) -> the rewrite`` of a rank of ``members`` whose honest peers wait ``timeout_s``."""
SLOW = {"slow_under": 0.8, "slow_over": 1.25}
"""The slow behaviours' delay of each step's first message, in timeouts."""
CRASH_STEP = 1
"""The step at whose first message ``crash`` closes the rank's connections."""


class Twisted:
    """A faulty rank's transport: ``rewrite`` replaces what it sends; ``sign_own`` signs what it forges;
    ``crash()``, the end of the ``crash`` behaviour (default: raise :class:`Crashed`; a fit's process exits)."""

    def __init__(self, inner: Any, rewrite: Rewrite, crash: Callable[[str], None] | None = None) -> None:
        self.inner, self.rewrite, self._crash = inner, rewrite, crash

    def crash(self, why: str) -> None:
        self.inner.close()  # the peers see the connections drop, as when a process dies
        if self._crash is not None:
            self._crash(why)
        raise Crashed(why)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def send(self, peer: int, step: int, phase: int, payload: bytes, tag: str = "") -> None:
        out = self.rewrite(self, peer, step, phase, payload)
        if out is not None:
            self.inner.send(peer, step, phase, out, tag=tag)


def _silent(members: Membership, timeout_s: float) -> Rewrite:
    return lambda link, peer, step, phase, payload: None


def _first_peer(members: Membership, rank: int) -> int:
    return next(r for r in members.members if r != rank)


def _equivocate(members: Membership, timeout_s: float) -> Rewrite:
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


def _forged_digest(members: Membership, timeout_s: float) -> Rewrite:
    def rewrite(link: Twisted, peer: int, step: int, phase: int, payload: bytes) -> bytes | None:
        if phase != INPUT or peer != _first_peer(members, link.rank):
            return payload
        commitment, claim, *pieces = wire.unpack(payload)
        return wire.pack([commitment, claim, *(bytes(len(p)) for p in pieces)])

    return rewrite


def _zeroed_values(phases: Callable[[int], bool]) -> Behaviour:
    def make(members: Membership, timeout_s: float) -> Rewrite:
        def rewrite(link: Twisted, peer: int, step: int, phase: int, payload: bytes) -> bytes | None:
            if not phases(phase):
                return payload
            values = wire.unpack_shard_values(payload)
            return wire.pack_shard_values({shard: bytes(len(value)) for shard, value in values.items()})

        return rewrite

    return make


def _wrong_vote(members: Membership, timeout_s: float) -> Rewrite:
    votes = {view_phase(v, k) for v in range(members.n) for k in (PREPARE, COMMIT)}
    return lambda link, peer, step, phase, payload: wire.sha256(b"no one proposed this") if phase in votes else payload


def _slow(timeouts: float) -> Behaviour:
    def make(members: Membership, timeout_s: float) -> Rewrite:
        def rewrite(link: Twisted, peer: int, step: int, phase: int, payload: bytes) -> bytes | None:
            if phase == INPUT and peer == _first_peer(members, link.rank):  # every later message waits behind it
                time.sleep(timeouts * timeout_s)
            return payload

        return rewrite

    return make


def _crash(members: Membership, timeout_s: float) -> Rewrite:
    def rewrite(link: Twisted, peer: int, step: int, phase: int, payload: bytes) -> bytes | None:
        if step >= CRASH_STEP:
            link.crash(f"rank {link.rank} crashed at step {step} (byzantine_rank_behaviour='crash')")
        return payload

    return rewrite


ALIE_Z = 1.0
"""``alie``'s ``z``: one standard deviation of the colluders' pool below its mean (the strength of the project's
``attack=alie`` runs; the paper's formula gives ``z <= 0`` at small ``n``, where the attack vanishes)."""
INPUT_BEHAVIOURS = frozenset({"alie"})
"""The behaviours that change the rows a rank commits to rather than its messages."""


def alie_rows(pool: Tensor, k: int, z: float = ALIE_Z) -> Tensor:
    """``k`` rows of ``mean - z x std`` over the colluders' pooled honest rows ``pool`` (``(m, d)``, ``m >= 2``:
    the sample deviation of ``torch.std``, as the reference ALIE implementations)."""
    if pool.shape[0] < 2:
        raise ValueError(f"alie needs at least 2 pooled rows to estimate a spread, got {pool.shape[0]}")
    return alie_row(pool, list(range(pool.shape[0])), z).expand(k, -1).clone()


class Crashed(RuntimeError):
    """Raised by the ``crash`` behaviour in the crashing rank's own code (a fit's process exits on it)."""


BEHAVIOURS: dict[str, Behaviour] = {
    "silent": _silent,
    "equivocate": _equivocate,
    "forged_digest": _forged_digest,
    "wrong_aggregate": _zeroed_values(lambda phase: phase == RESULT),
    "wrong_partial": _zeroed_values(lambda phase: TOTALS <= phase < PHASE_BASE),
    "wrong_vote": _wrong_vote,
    **{name: _slow(timeouts) for name, timeouts in SLOW.items()},
    "crash": _crash,
    "alie": lambda members, timeout_s: lambda link, peer, step, phase, payload: payload,  # the rows, not the wire
}
"""The behaviours by name."""


def check_behaviour(
    behaviour: object, ranks: object, world_size: int | None = None, f: int = 1, workers_per_rank: int = 1
) -> None:
    """``byzantine_rank_behaviour`` is ``None`` or a name of :data:`BEHAVIOURS`; ``byzantine_behaving_ranks`` ranks of
    the job (``None``: the world size is not known yet; default: the last ``f``); ``alie``'s colluders pool at least
    two rows."""
    if behaviour is not None and behaviour not in BEHAVIOURS:
        raise ValueError(
            f"byzantine_rank_behaviour={behaviour!r} is invalid: expected None or one of {list(BEHAVIOURS)}"
        )
    if ranks is not None:
        if not isinstance(ranks, (list, tuple)) or not all(isinstance(r, int) and r >= 0 for r in ranks):
            raise ValueError(f"byzantine_behaving_ranks={ranks!r} is invalid: expected a list of ranks")
        if world_size is not None and any(r >= world_size for r in ranks):
            raise ValueError(f"byzantine_behaving_ranks={list(ranks)} is invalid for {world_size} processes")
    if behaviour == "alie":
        colluders = f if ranks is None else len(set(ranks))
        if colluders * workers_per_rank < 2:
            raise ValueError(
                f"byzantine_rank_behaviour='alie' with {colluders} behaving rank(s) x workers_per_rank="
                f"{workers_per_rank}: the colluders need at least 2 rows of their own to estimate a spread"
            )
