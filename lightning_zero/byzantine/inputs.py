"""The inputs of one Byzantine-ranks step: each member's rows committed by a signed digest per column shard, the
echo that turns an equivocation into a proof, and the agreed input set. Pure functions over bytes and keys.

Runbook (one member, step ``s``; :mod:`lightning_zero.byzantine.step` sends and receives)::

    commit = Commitment.of(rows, members)                     # sha256 of each shard's columns of the (k, d) rows
    signed = transport.sign_own(s, COMMITMENT, commit.encode())
    frame = input_frame(commit, signed, pieces_for(peer))     # to each member: its shards' columns
    held = check_input(frame, sender, s, keys, members, commit) # -> Held, or a Proof of the sender
    proofs = compare(held_by_me, echoed)                      # two signed commitments of one rank: equivocation
    value = propose(...); why = validate(value, ...)          # the set of inputs the step aggregates

[Note: committed inputs] A member's commitment is ``(d, k, dtype, sha256 of each of the n column shards of its
rows)``, signed once for the step (the transport's :meth:`~lightning_zero.comm.signed.SignedTransport.sign_own`
claim at phase :data:`COMMITMENT`: transferable). The member sends every other member the commitment and that
member's shards' columns; the receiver checks the columns against the digests. Columns that do not match a
commitment signed by the same sender are a proof (the frame is signed): a *forged digest*. Each member then echoes
the commitments it holds, flagged when it also holds (and checked) the columns of its shards: two validly signed
commitments of one member for one step are a proof of *equivocation*, whoever holds both.

The proposal agreed on (:mod:`lightning_zero.byzantine.agreement`) lists, per member, its signed commitment or
nothing, with the echoes it rests on: a member is included only when, for every shard, ``f + 1`` of the shard's
aggregators (echoes or the proposer itself) hold its columns, so that at least one honest aggregator can hand them to
another that lacks them; at most ``f`` members may be left out. Every member checks all of it from the signatures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from lightning_zero.byzantine import wire
from lightning_zero.byzantine.membership import Membership
from lightning_zero.comm.signed import Evidence, verify_evidence
from lightning_zero.robust.shards import ColumnLayout

COMMITMENT = 0
"""The phase of a commitment's signed claim (never a frame's: frames start at phase 1)."""
INPUT, ECHO = 1, 2
"""The transport phases of the input frames and of the echoes."""


@dataclasses.dataclass(frozen=True)
class Proof:
    """Signed messages that prove ``rank`` faulty (``kind``: ``equivocation``, ``forged_digest``,
    ``wrong_aggregate`` or ``malformed``), each ``(payload, evidence)``, checkable by anyone with the keys."""

    rank: int
    kind: str
    detail: str
    messages: tuple[tuple[bytes, Evidence], ...]


@dataclasses.dataclass(frozen=True)
class Commitment:
    """``width`` columns, ``rows`` rows of ``dtype``, and the sha256 of each column shard's bytes."""

    width: int
    rows: int
    dtype: str
    digests: tuple[bytes, ...]

    @classmethod
    def of(cls, rows: Tensor, members: Membership) -> tuple[Commitment, list[bytes]]:
        """The commitment of ``rows`` (``(k, d)``) and the bytes of each shard's columns."""
        layout = ColumnLayout.contiguous(rows.shape[1], members.n)
        pieces = [piece_bytes(layout.take(rows, c)) for c in range(members.n)]
        return cls(rows.shape[1], rows.shape[0], str(rows.dtype), tuple(map(wire.sha256, pieces))), pieces

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype.removeprefix("torch."))

    def piece_size(self, columns: int) -> int:
        """The bytes of ``columns`` columns of the rows."""
        return self.rows * columns * torch.empty((), dtype=self.torch_dtype).element_size()

    def encode(self) -> bytes:
        return wire.pack([wire.pack_int(self.width), wire.pack_int(self.rows), self.dtype.encode(), *self.digests])

    @classmethod
    def decode(cls, data: bytes, expected: Commitment) -> Commitment:
        """A commitment that must match ``expected``'s shape and dtype (every member's rows are alike)."""
        parts = wire.unpack(data)
        if len(parts) != 3 + len(expected.digests):
            raise ValueError(f"a commitment of {len(parts) - 3} digests, expected {len(expected.digests)}")
        commit = cls(wire.unpack_int(parts[0]), wire.unpack_int(parts[1]), parts[2].decode(errors="replace"),
                     tuple(parts[3:]))  # fmt: skip
        if (commit.width, commit.rows, commit.dtype) != (expected.width, expected.rows, expected.dtype):
            raise ValueError(
                f"a commitment to {commit.rows} x {commit.width} {commit.dtype} rows, expected"
                f" {expected.rows} x {expected.width} {expected.dtype}"
            )
        if any(len(d) != 32 for d in commit.digests):
            raise ValueError("a commitment with a digest that is not 32 bytes")
        return commit


def piece_bytes(columns: Tensor) -> bytes:
    """The bytes of a shard's columns (``(k, w)``), row-major."""
    return columns.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def piece_tensor(data: bytes, rows: int, dtype: torch.dtype) -> Tensor:
    """:func:`piece_bytes` undone."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(rows, -1)


def check_claim(claim: Evidence, sender: int, step: int, payload: bytes, keys: Mapping[int, bytes]) -> bool:
    """Whether ``claim`` is ``sender``'s signed commitment ``payload`` for ``step``."""
    signer, _, c_step, phase, length = claim.fields
    return (
        (signer, c_step, phase, length) == (sender, step, COMMITMENT, len(payload))
        and claim.digest == wire.sha256(payload)
        and verify_evidence(keys[sender], claim)
    )


@dataclasses.dataclass(frozen=True)
class Held:
    """A member's signed commitment as held here, and its columns of this member's shards (checked)."""

    commitment: bytes
    claim: Evidence
    pieces: dict[int, bytes]


def input_frame(commitment: bytes, claim: Evidence, pieces: Sequence[bytes]) -> bytes:
    """What a member sends a peer: its signed commitment and the peer's shards' columns (in ``shards_of`` order)."""
    return wire.pack([commitment, wire.pack_evidence(claim), *pieces])


def check_input(
    payload: bytes, sender: int, step: int, receiver: int, keys: Mapping[int, bytes], members: Membership,
    expected: Commitment,
) -> Held:  # fmt: skip
    """``sender``'s input frame, checked: its commitment signed by it for ``step``, each of ``receiver``'s shards'
    columns of the committed size and digest. Raises :class:`ValueError` naming what is wrong."""
    shards = members.shards_of(receiver)
    parts = wire.unpack(payload, count=2 + len(shards))
    commitment, claim = parts[0], wire.unpack_evidence(parts[1])
    if not check_claim(claim, sender, step, commitment, keys):
        raise ValueError("an input whose commitment is not signed by its sender for this step")
    commit = Commitment.decode(commitment, expected)
    layout = ColumnLayout.contiguous(expected.width, members.n)
    pieces = {}
    for shard, piece in zip(shards, parts[2:]):
        if len(piece) != expected.piece_size(layout.size(shard)):
            raise ValueError(f"shard {shard}'s columns of {len(piece)} bytes, not the committed size")
        if wire.sha256(piece) != commit.digests[shard]:
            raise ValueError(f"shard {shard}'s columns do not match the digest the sender signed (a forged digest)")
        pieces[shard] = piece
    return Held(commitment, claim, pieces)


def echo_payload(
    held: Mapping[int, Held], signed: Mapping[int, tuple[bytes, Evidence]], members: Membership,
    proofs: Sequence[bytes] = (),
) -> bytes:  # fmt: skip
    """Every member's signed commitment this member knows (``signed``), flagged ``1`` where its columns are held
    and checked (``held``), else ``0``; an empty part for a member it knows nothing of. Then the encoded ``proofs``
    this member spreads (:mod:`lightning_zero.byzantine.proofs`)."""
    parts = []
    for rank in members.members:
        if rank in signed:
            commitment, claim = signed[rank]
            flag = b"\x01" if rank in held else b"\x00"
            parts.append(wire.pack([commitment, wire.pack_evidence(claim), flag]))
        else:
            parts.append(b"")
    return wire.pack([wire.pack(parts), wire.pack(list(proofs))])


def read_echo(
    payload: bytes, step: int, keys: Mapping[int, bytes], members: Membership
) -> tuple[dict[int, tuple[bytes, Evidence, bool]], list[bytes]]:
    """An echo's entries ``{rank: (commitment, claim, holds its columns)}``, each claim checked, and the encoded
    proofs it spreads (checked by the caller). Raises :class:`ValueError` on an entry no honest member writes."""
    entries_raw, proofs_raw = wire.unpack(payload, count=2)
    parts = wire.unpack(entries_raw, count=members.n)
    out = {}
    for rank, part in zip(members.members, parts):
        if part:
            commitment, raw, flag = wire.unpack(part, count=3)
            claim = wire.unpack_evidence(raw)
            if flag not in (b"\x00", b"\x01") or not check_claim(claim, rank, step, commitment, keys):
                raise ValueError(f"an echo whose entry for rank {rank} is not that rank's signed commitment")
            out[rank] = (commitment, claim, flag == b"\x01")
    return out, wire.unpack(proofs_raw)


def equivocation(rank: int, a: tuple[bytes, Evidence], b: tuple[bytes, Evidence]) -> Proof | None:
    """The proof that ``rank`` signed both commitments, when they differ."""
    if a[0] == b[0]:
        return None
    return Proof(rank, "equivocation", f"rank {rank} signed two different commitments for one step", (a, b))


@dataclasses.dataclass(frozen=True)
class Proposal:
    """The step's agreed inputs: ``included`` ``{rank: (commitment, claim)}``, the signed echoes ``{sender: (payload,
    evidence)}`` that show ``f + 1`` holders of each included member's columns per shard, and ``evicted``
    ``{rank: encoded proof}``: the members leaving after this step."""

    included: dict[int, tuple[bytes, Evidence]]
    echoes: dict[int, tuple[bytes, Evidence]]
    evicted: dict[int, bytes] = dataclasses.field(default_factory=dict)

    def encode(self, members: Membership) -> bytes:
        entries = [
            wire.pack([self.included[r][0], wire.pack_evidence(self.included[r][1])]) if r in self.included else b""
            for r in members.members
        ]
        echoes = [
            wire.pack([wire.pack_int(r), payload, wire.pack_evidence(ev)]) for r, (payload, ev) in self.echoes.items()
        ]
        evicted = [wire.pack([wire.pack_int(r), proof]) for r, proof in sorted(self.evicted.items())]
        return wire.pack([wire.pack(entries), wire.pack(echoes), wire.pack(evicted)])

    def holders(self, step: int, keys: Mapping[int, bytes], members: Membership) -> dict[int, dict[int, set[int]]]:
        """``{rank: {shard: the aggregators whose echo holds rank's columns of that commitment}}`` (echoes checked)."""
        out: dict[int, dict[int, set[int]]] = {r: {} for r in self.included}
        for sender, (payload, ev) in self.echoes.items():
            signer, _, e_step, phase, length = ev.fields
            if (signer, e_step, phase, length) != (sender, step, ECHO, len(payload)):
                raise ValueError(f"an echo attributed to rank {sender} that is not its signed echo of this step")
            if ev.digest != wire.sha256(payload) or not verify_evidence(keys[sender], ev):
                raise ValueError(f"an echo attributed to rank {sender} with a bad signature")
            for rank, (commitment, _, holds) in read_echo(payload, step, keys, members)[0].items():
                if holds and rank in self.included and commitment == self.included[rank][0]:
                    for shard in members.shards_of(sender):
                        out[rank].setdefault(shard, set()).add(sender)
        return out


def choose(
    known: Mapping[int, tuple[bytes, Evidence]], echoes: Mapping[int, tuple[bytes, Evidence]],
    proofs: Mapping[int, Proof], step: int, keys: Mapping[int, bytes], members: Membership,
    evictions: Mapping[int, bytes] | None = None,
) -> Proposal:  # fmt: skip
    """The proposal of a leader that knows the signed commitments ``known`` and received ``echoes`` (its own among
    them): every member not proven faulty whose columns ``f + 1`` aggregators of every shard hold; ``evictions``:
    the encoded proofs that evict their ranks."""
    candidate = Proposal({r: v for r, v in known.items() if r not in proofs}, dict(echoes))
    holders = candidate.holders(step, keys, members)
    enough = members.acceptance
    included = {
        r: v
        for r, v in candidate.included.items()
        if all(len(holders[r].get(shard, ())) >= enough for shard in range(members.n))
    }
    return Proposal(included, dict(echoes), dict(evictions or {}))


def check_proposal(
    value: bytes, step: int, keys: Mapping[int, bytes], members: Membership, proofs: Mapping[int, Proof],
    check_eviction: Callable[[int, bytes], str | None] = lambda rank, proof: "no eviction is checked here",
) -> Proposal:  # fmt: skip
    """Decode and check a proposal ([Note: committed inputs]); raises :class:`ValueError` saying why it is not
    acceptable to a member holding ``proofs``; ``check_eviction(rank, proof)``: why an eviction's proof does not
    hold, or ``None``."""
    entries_raw, echoes_raw, evicted_raw = wire.unpack(value, count=3)
    entries = wire.unpack(entries_raw, count=members.n)
    included = {}
    for rank, entry in zip(members.members, entries):
        if entry:
            commitment, raw = wire.unpack(entry, count=2)
            claim = wire.unpack_evidence(raw)
            if not check_claim(claim, rank, step, commitment, keys):
                raise ValueError(f"rank {rank}'s included commitment is not signed by it for step {step}")
            if rank in proofs:
                raise ValueError(f"it includes rank {rank}, proven faulty ({proofs[rank].kind})")
            included[rank] = (commitment, claim)
    if members.n - len(included) > members.f:
        raise ValueError(f"it leaves out {members.n - len(included)} members, more than f={members.f}")
    echoes = {}
    for part in wire.unpack(echoes_raw):
        sender_raw, payload, raw = wire.unpack(part, count=3)
        sender = wire.unpack_int(sender_raw)
        if sender not in members.members or sender in echoes:
            raise ValueError(f"an echo of rank {sender}, not a member or twice")
        echoes[sender] = (payload, wire.unpack_evidence(raw))
    evicted = {}
    for part in wire.unpack(evicted_raw):
        rank_raw, proof = wire.unpack(part, count=2)
        rank = wire.unpack_int(rank_raw)
        why = check_eviction(rank, proof)
        if why is not None or rank in included or rank in evicted:
            raise ValueError(f"it evicts rank {rank} without a proof that holds: {why or 'the rank is included'}")
        evicted[rank] = proof
    proposal = Proposal(included, echoes, evicted)
    holders = proposal.holders(step, keys, members)
    for rank in included:
        for shard in range(members.n):
            if len(holders[rank].get(shard, ())) < members.acceptance:
                raise ValueError(
                    f"it includes rank {rank} with {len(holders[rank].get(shard, ()))} echoed holders of its shard"
                    f" {shard} columns, fewer than f + 1 = {members.acceptance}"
                )
    return proposal
