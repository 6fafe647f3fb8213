"""Proofs of misbehaviour that travel: encoded, sent to every member inside the echo, and checked by anyone from the
signed messages alone before the agreement evicts the proven rank.

Runbook::

    data = encode(proof)                                   # what the echo carries
    proof = decode(data)
    why = check(proof, keys, members_at_its_step, expected)   # None: it proves proof.rank faulty

[Note: transferable proofs] A proof is the faulty rank's own signed messages, and whatever else is needed to see
that no honest rank sends them:

- ``equivocation``: two commitments it signed for one step (:mod:`lightning_zero.byzantine.inputs`), different;
- ``forged_digest``: an input frame it signed whose columns do not hash to the digests its commitment (inside the
  same frame) signs; the frame's header names the receiver, whose shards the columns were for;
- ``wrong_aggregate``: a shard result or partial sum it signed, and ``f + 1`` of the shard's other aggregators'
  signed frames that agree on another value (with at most ``f`` faulty, one of them is honest).

A proof of a step is checked against the membership of that step (the shard assignment and ``f`` may have changed
since). ``malformed`` messages are kept by the rank that received them and not spread: a checker would have to
redo the receiver's parsing of every phase.

[Note: eviction] Each member spreads the travelling proofs it holds in the next echo; a leader proposes to evict
every member it holds a checked proof against, and a member votes for the proposal only after checking each proof
itself. A decided proposal thus evicts with a quorum's checks behind it (``2f + 1`` at ``n = 3f + 1``), and every
honest member leaves the rank out from the next step, at the same step. A member left out of ``evict_after``
decided steps in a row (default ``f + 1``, the fewest that cannot all be led by faulty ranks, since an honest leader
includes every member whose columns arrived in time) is evicted too: its silence is the decided record, the same on
every honest member. An evicted rank is one of the ``f`` (:meth:`~lightning_zero.byzantine.membership.Membership.
without` lowers ``f``); the rule keeps seeing the job's ``n`` rows, the evicted rank's as NaN rows that it drops.
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning_zero.byzantine import inputs, wire
from lightning_zero.byzantine.inputs import INPUT, Commitment, Proof
from lightning_zero.byzantine.membership import Membership
from lightning_zero.comm.signed import Evidence, verify_evidence

SPREAD = ("equivocation", "forged_digest", "wrong_aggregate")
"""The kinds that travel."""


def encode(proof: Proof) -> bytes:
    messages = [wire.pack([payload, wire.pack_evidence(ev)]) for payload, ev in proof.messages]
    return wire.pack([wire.pack_int(proof.rank), proof.kind.encode(), proof.detail.encode(), *messages])


def decode(data: bytes) -> Proof:
    """Raises :class:`ValueError` on bytes :func:`encode` does not write."""
    rank_raw, kind, detail, *raw = wire.unpack(data)
    messages = []
    for part in raw:
        payload, ev = wire.unpack(part, count=2)
        messages.append((payload, wire.unpack_evidence(ev)))
    return Proof(wire.unpack_int(rank_raw), kind.decode(errors="replace"), detail.decode(errors="replace"),
                 tuple(messages))  # fmt: skip


def step_of(proof: Proof) -> int:
    """The step of the proof's messages (from their signed headers or claims)."""
    return proof.messages[0][1].fields[2]


def _signed_frame(payload: bytes, ev: Evidence, keys: Mapping[int, bytes]) -> bool:
    sender = ev.fields[0]
    return (
        sender in keys
        and ev.fields[4] == len(payload)
        and ev.digest == wire.sha256(payload)
        and (verify_evidence(keys[sender], ev))
    )


def check(proof: Proof, keys: Mapping[int, bytes], members: Membership, expected: Commitment) -> str | None:
    """``None`` when ``proof`` proves ``proof.rank`` faulty under ``members`` (its step's), else why not; ``expected``:
    the shape of every member's commitment."""
    if proof.kind not in SPREAD:
        return f"a proof of kind {proof.kind!r}, which does not travel"
    if proof.rank not in members.members or not proof.messages:
        return f"a proof against rank {proof.rank}, not a member of its step"
    step = step_of(proof)
    if proof.kind == "equivocation":
        if len(proof.messages) != 2:
            return "an equivocation proof without two commitments"
        (a, ca), (b, cb) = proof.messages
        if a == b or not all(inputs.check_claim(c, proof.rank, step, p, keys) for p, c in ((a, ca), (b, cb))):
            return "an equivocation proof whose commitments are not two different ones signed for one step"
        return None
    if not all(_signed_frame(p, ev, keys) for p, ev in proof.messages):
        return "a proof holding a frame that is not signed by its sender"
    if proof.kind == "forged_digest":
        (payload, ev), *_ = proof.messages
        sender, receiver, _, phase, _ = ev.fields
        if (sender, phase) != (proof.rank, INPUT) or receiver not in members.members:
            return "a forged-digest proof whose frame is not an input frame of the rank"
        try:
            inputs.check_input(payload, sender, step, receiver, keys, members, expected)
        except ValueError as err:
            return None if "forged digest" in str(err) else f"a forged-digest proof of another fault: {err}"
        return "a forged-digest proof whose columns match the signed digests"
    return _check_wrong_aggregate(proof, members, step)


def _check_wrong_aggregate(proof: Proof, members: Membership, step: int) -> str | None:
    (payload, ev), *witnesses = proof.messages
    phase = ev.fields[3]
    if ev.fields[0] != proof.rank or any(w.fields[2:4] != (step, phase) for _, w in witnesses):
        return "a wrong-aggregate proof whose frames are not of one step and phase"
    try:
        sent = wire.unpack_shard_values(payload)
        seen = {w.fields[0]: wire.unpack_shard_values(p) for p, w in witnesses}
    except ValueError:
        return "a wrong-aggregate proof holding a frame that does not parse"
    for shard, value in sent.items():
        if not 0 <= shard < members.n or proof.rank not in members.aggregators(shard):
            continue
        by_value: dict[bytes, set[int]] = {}
        for r, values in seen.items():
            if r != proof.rank and r in members.aggregators(shard) and shard in values:
                by_value.setdefault(values[shard], set()).add(r)
        if any(v != value and len(rs) >= members.acceptance for v, rs in by_value.items()):
            return None
    return f"a wrong-aggregate proof without f + 1 = {members.acceptance} aggregators agreeing on another value"
