"""Columns of included members that did not reach a member: asked of the holders the agreed proposal names, checked
against the signed commitment ([Note: committed inputs] in :mod:`lightning_zero.byzantine.inputs`).

Runbook (inside :meth:`lightning_zero.byzantine.step.StepProtocol.run`, after the agreement)::

    recover(protocol, step, proposal, held, commit)   # held[rank].pieces gains what was missing

The request round always runs (an empty request costs a header and a signature per peer): every member must answer
the requests it gets, and cannot know in advance that none will come. So does the wait for pieces, at once over when
nothing was asked: it keeps this member's rounds on the schedule of the others ([Note: rounds] in
:mod:`lightning_zero.byzantine.step`).
"""

from __future__ import annotations

from typing import Any

from lightning_zero.byzantine import wire
from lightning_zero.byzantine.inputs import Commitment, Held, Proposal
from lightning_zero.robust.shards import ColumnLayout

REQUEST, PIECES = 3, 4
"""Transport phases of the requests and of the columns sent on request."""


def recover(protocol: Any, step: int, proposal: Proposal, held: dict[int, Held], commit: Commitment) -> None:
    """Columns of included members that did not reach this member, asked of the echoed holders of each shard;
    every member answers every request for what it holds, and every answer is checked against the commitment."""
    members, me, keys = protocol.membership, protocol.me, protocol.transport.public_keys
    holders = proposal.holders(step, keys, members)
    asks: dict[int, list[tuple[int, int]]] = {peer: [] for peer in protocol.peers}
    for rank in proposal.included:
        for shard in members.shards_of(me):
            if rank not in held or shard not in held[rank].pieces:
                for holder in holders[rank].get(shard, ()):
                    if holder in asks:
                        asks[holder].append((rank, shard))
    for peer in protocol.peers:
        ask = wire.pack([wire.pack([wire.pack_int(r), wire.pack_int(c)]) for r, c in asks[peer]])
        protocol.send(peer, step, REQUEST, ask, "byzantine_request")
    for peer, (payload, _) in protocol.collect(step, REQUEST, set(protocol.peers)).items():
        try:
            wanted = [tuple(map(wire.unpack_int, wire.unpack(p, count=2))) for p in wire.unpack(payload)]
        except ValueError:
            continue
        answers = []
        for rank, shard in wanted:
            h = held.get(rank)
            if h is not None and shard in h.pieces and rank in proposal.included:
                parts = [wire.pack_int(rank), wire.pack_int(shard), h.commitment, wire.pack_evidence(h.claim)]
                answers.append(wire.pack([*parts, h.pieces[shard]]))
        if answers:
            protocol.send(peer, step, PIECES, wire.pack(answers), "byzantine_pieces")
    layout = ColumnLayout.contiguous(commit.width, members.n)
    needed = {pair for pairs in asks.values() for pair in pairs}

    def covered(got: dict[int, Any]) -> bool:  # every piece asked for is offered (checked below)
        offered = set()
        for payload, _ in got.values():
            try:
                offered |= {tuple(map(wire.unpack_int, wire.unpack(a)[:2])) for a in wire.unpack(payload)}
            except ValueError:
                continue
        return needed <= offered

    for payload, _ in protocol.collect(step, PIECES, {h for h, a in asks.items() if a}, covered).values():
        try:
            received = [wire.unpack(a, count=5) for a in wire.unpack(payload)]
        except ValueError:
            continue
        for rank_raw, shard_raw, commitment, raw, piece in received:
            try:
                rank, shard = wire.unpack_int(rank_raw), wire.unpack_int(shard_raw)
                claim = wire.unpack_evidence(raw)
            except ValueError:
                continue
            if rank not in proposal.included or commitment != proposal.included[rank][0]:
                continue
            digests = Commitment.decode(commitment, commit).digests
            size = commit.piece_size(layout.size(shard))
            if shard in members.shards_of(me) and len(piece) == size and wire.sha256(piece) == digests[shard]:
                entry = held.setdefault(rank, Held(commitment, claim, {}))
                entry.pieces.setdefault(shard, piece)
