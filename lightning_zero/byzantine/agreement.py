"""Agreement on one value per training step among members of whom up to ``f`` are Byzantine: single-decree PBFT with
a rotating leader, certificates of signed votes, and a view change when a leader fails.

Runbook::

    agreement = Agreement(transport, Membership.of(4, f=1), timeout_s=5.0)
    decision = agreement.decide(step, propose=lambda: my_value, validate=lambda value: None)  # None: acceptable
    decision.value                  # the same bytes on every honest rank
    decision.certificate            # a quorum of signed commits: proves the decision to anyone holding the keys
    agreement.misbehaviour          # signed messages that prove their sender faulty (a malformed proposal, ...)

[Note: agreement] One instance per step, over :class:`~lightning_zero.comm.signed.SignedTransport` (every message
signed and held with its :class:`~lightning_zero.comm.signed.Evidence`). In view ``w`` the leader is
:meth:`Membership.leader(step, w) <lightning_zero.byzantine.membership.Membership.leader>`:

1. *pre-prepare*: the leader sends its value (``propose()``) to every member;
2. *prepare*: a member that accepts it (``validate(value) is None``) sends ``sha256(value)``; a quorum of matching
   prepares (its own included) makes the value *prepared* in ``w``, with those signed votes as its certificate;
3. *commit*: a member that prepared sends a commit; a quorum of matching commits *decides* the value. The deciding
   member sends the commit certificate with the value to every member, which decides on checking it (a member that
   missed the leader's message, or is behind in views, catches up so).

*View change*: a member that has not decided ``timeout_s x (w + 1)`` seconds after entering view ``w`` (or that
sees ``f + 1`` members ask for a later view: one of them honest) sends a view change for ``w + 1`` carrying its
highest prepared certificate. The new leader gathers a quorum of them and proposes the value of the highest
certificate among them (its own ``propose()`` if none), sending the quorum along as justification; members check
both. Safety: a decided value was prepared by ``f + 1`` honest members ([Note: counting] in
:mod:`lightning_zero.byzantine.membership`), so every quorum of view changes after it carries its certificate, and
no later view proposes another value. Liveness: with at most ``f`` faulty leaders in a row and honest messages
within the timeout, a view with an honest leader decides; after ``max_views`` views (default ``n``: every member
led once) :class:`NoAgreement` is raised, on every honest rank, instead of waiting for ever.

Messages per decision in the fault-free case: ``n - 1`` pre-prepares, ``2 n (n - 1)`` votes and ``n (n - 1)``
decisions, each a few hundred bytes; the certificates hold ``quorum`` signatures of 64 bytes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_zero.byzantine import wire
from lightning_zero.byzantine.membership import Membership
from lightning_zero.comm.signed import Evidence, PeerGone, PeerTimeout, verify_evidence

PRE_PREPARE, PREPARE, COMMIT, VIEW_CHANGE = range(4)
KINDS = ("pre-prepare", "prepare", "commit", "view change")
PHASE_BASE = 1 << 20
"""The first transport phase of the agreement's messages (its decision message); the views' phases follow."""


def view_phase(view: int, kind: int, base: int = PHASE_BASE) -> int:
    """The transport phase of a ``kind`` message (:data:`PRE_PREPARE` ...) of ``view``."""
    return base + 1 + view * len(KINDS) + kind


class NoAgreement(RuntimeError):
    """No value was decided for a step within ``max_views`` views: more faulty members than ``f``, or messages
    slower than the timeout. Raised on every honest rank (none applies the step)."""


@dataclass(frozen=True)
class Certificate:
    """A quorum of signed votes of one ``kind`` (:data:`PREPARE` or :data:`COMMIT`) for ``sha256(value)`` in a view."""

    step: int
    view: int
    kind: int
    value: bytes
    votes: tuple[Evidence, ...]

    def encode(self) -> bytes:
        return wire.pack([wire.pack_int(self.view), self.value, *map(wire.pack_evidence, self.votes)])


@dataclass(frozen=True)
class Decision:
    """The value decided for ``step`` in ``view``, and the commit certificate that proves it."""

    step: int
    view: int
    value: bytes
    certificate: Certificate


@dataclass(frozen=True)
class Misbehaviour:
    """A signed message of ``rank`` that no honest member sends (``reason``): ``payload`` and its ``evidence`` prove
    it to anyone who checks the payload again."""

    rank: int
    reason: str
    payload: bytes
    evidence: Evidence


@dataclass
class _View:
    value: bytes | None = None  # the leader's accepted value
    proposed: bool = False  # this member sent its pre-prepare (as leader)
    prepared: bool = False  # this member sent its prepare
    committed: bool = False  # this member sent its commit
    prepares: dict[int, tuple[bytes, Evidence]] = field(default_factory=dict)
    commits: dict[int, tuple[bytes, Evidence]] = field(default_factory=dict)
    changes: dict[int, tuple[bytes, Evidence]] = field(default_factory=dict)  # view changes *into* this view


class Agreement:
    """Single-decree PBFT per step ([Note: agreement]) for one member.

    Args:
        transport: this member's :class:`~lightning_zero.comm.signed.SignedTransport` (or any object with its
            ``rank``, ``public_keys``, ``send``, ``take`` and ``sign_own``).
        membership: who votes, and ``f``.
        timeout_s: the first view's deadline; view ``w`` waits ``(w + 1)`` times as long.
        max_views: the views tried before :class:`NoAgreement` (default: the number of members).
        phase_base: the transport phases used are ``[phase_base, phase_base + 1 + 4 max_views)``.
        tag: the ledger tag of the messages.
    """

    def __init__(
        self,
        transport: Any,
        membership: Membership,
        *,
        timeout_s: float = 10.0,
        max_views: int | None = None,
        phase_base: int = PHASE_BASE,
        tag: str = "agreement",
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} is invalid: expected a number of seconds > 0")
        self.transport, self.membership, self.timeout_s = transport, membership, float(timeout_s)
        self.max_views = membership.n if max_views is None else int(max_views)
        self.phase_base, self.tag = phase_base, tag
        self.me = transport.rank
        self.misbehaviour: list[Misbehaviour] = []
        self.rejected: dict[tuple[int, int], str] = {}
        """``{(step, view): why}``: the proposals ``validate`` turned down."""

    # ---------------------------------------------------------------------------------------------- phases
    @property
    def phases(self) -> range:
        return range(self.phase_base, self.phase_base + 1 + len(KINDS) * self.max_views)

    def _phase(self, view: int, kind: int) -> int:
        return view_phase(view, kind, self.phase_base)

    def _kind_of(self, phase: int) -> tuple[int, int]:
        """``(view, kind)`` of a view phase."""
        return divmod(phase - self.phase_base - 1, len(KINDS))

    # ---------------------------------------------------------------------------------------------- checks
    def _valid_vote(self, evidence: Evidence, step: int, view: int, kind: int, payload: bytes) -> int | None:
        """The member who signed ``evidence`` as its ``kind`` vote for ``payload`` in ``(step, view)``, or ``None``."""
        sender, _, e_step, e_phase, length = evidence.fields
        if sender not in self.membership.members or (e_step, e_phase) != (step, self._phase(view, kind)):
            return None
        if length != len(payload) or evidence.digest != wire.sha256(payload):
            return None
        return sender if verify_evidence(self.transport.public_keys[sender], evidence) else None

    def _check_certificate(self, step: int, kind: int, parts: list[bytes], before_view: int | None) -> Certificate:
        """Decode and check a certificate (:meth:`Certificate.encode`'s ``parts``): a quorum of distinct members'
        valid votes of ``kind`` for the value; ``before_view``: its view must be lower."""
        if len(parts) < 2:
            raise ValueError("a certificate without view and value")
        view, value = wire.unpack_int(parts[0]), parts[1]
        if not 0 <= view < self.max_views or (before_view is not None and view >= before_view):
            raise ValueError(f"a certificate of view {view}")
        votes = tuple(wire.unpack_evidence(p) for p in parts[2:])
        signers = {self._valid_vote(e, step, view, kind, wire.sha256(value)) for e in votes}
        signers.discard(None)
        if len(signers) < self.membership.quorum:
            raise ValueError(f"a {KINDS[kind]} certificate of {len(signers)} valid votes, fewer than a quorum")
        return Certificate(step, view, kind, value, votes)

    def _highest(self, step: int, view: int, changes: list[bytes]) -> Certificate | None:
        """The highest prepared certificate among the view changes' payloads (each already checked)."""
        best = None
        for payload in changes:
            parts = wire.unpack(payload)
            if parts:
                cert = self._check_certificate(step, PREPARE, parts, before_view=view)
                if best is None or cert.view > best.view:
                    best = cert
        return best

    # ---------------------------------------------------------------------------------------------- sending
    def _broadcast(self, step: int, phase: int, payload: bytes) -> Evidence:
        """``payload`` to every other member; the own signed copy returned. A peer gone or not reading is skipped:
        its silence is dealt with by the deadlines."""
        for peer in self.membership.members:
            if peer != self.me:
                with contextlib.suppress(PeerGone, PeerTimeout):
                    self.transport.send(peer, step, phase, payload, tag=self.tag)
        return self.transport.sign_own(step, phase, payload)

    def _vote(self, step: int, view: int, kind: int, views: dict[int, _View]) -> None:
        value = views[view].value
        assert value is not None
        digest = wire.sha256(value)
        evidence = self._broadcast(step, self._phase(view, kind), digest)
        table = views[view].prepares if kind == PREPARE else views[view].commits
        table[self.me] = (digest, evidence)

    # ---------------------------------------------------------------------------------------------- receiving
    def _receive(
        self, step: int, sender: int, phase: int, payload: bytes, evidence: Evidence, views: dict[int, _View],
        validate: Callable[[bytes], str | None],
    ) -> Decision | None:  # fmt: skip
        """Record one message; a valid decision is returned."""
        if sender not in self.membership.members:
            return None
        try:
            if phase == self.phase_base:
                cert = self._check_certificate(step, COMMIT, wire.unpack(payload), before_view=None)
                return Decision(step, cert.view, cert.value, cert)
            view, kind = self._kind_of(phase)
            state = views.setdefault(view, _View())
            if kind == PRE_PREPARE:
                if sender != self.membership.leader(step, view) or state.value is not None:
                    return None
                value = self._justified(step, view, wire.unpack(payload))
                reason = validate(value)
                if reason is None:
                    state.value = value
                else:  # the leader may be honest and see more or less than this member: no proof
                    self.rejected[(step, view)] = reason
            elif kind in (PREPARE, COMMIT):
                if len(payload) != 32:
                    raise ValueError(f"a {KINDS[kind]} of {len(payload)} bytes")
                (state.prepares if kind == PREPARE else state.commits).setdefault(sender, (payload, evidence))
            elif view >= 1:  # a view change into ``view``
                parts = wire.unpack(payload)
                if parts:
                    self._check_certificate(step, PREPARE, parts, before_view=view)
                state.changes.setdefault(sender, (payload, evidence))
            else:
                raise ValueError("a view change into view 0")
        except ValueError as err:
            self.misbehaviour.append(Misbehaviour(sender, str(err), payload, evidence))
        return None

    def _justified(self, step: int, view: int, parts: list[bytes]) -> bytes:
        """A pre-prepare's value, checked against its justification (views >= 1: a quorum of view changes)."""
        if not parts:
            raise ValueError("a pre-prepare without a value")
        value, justification = parts[0], parts[1:]
        if view == 0:
            if justification:
                raise ValueError("a view-0 pre-prepare with a justification")
            return value
        if len(justification) % 2:
            raise ValueError("a justification of unpaired view changes")
        changes, signers = [], set()
        for payload, raw in zip(justification[::2], justification[1::2]):
            signer = self._valid_vote(wire.unpack_evidence(raw), step, view, VIEW_CHANGE, payload)
            if signer is not None and signer not in signers:
                signers.add(signer)
                changes.append(payload)
        if len(signers) < self.membership.quorum:
            raise ValueError(f"a new view justified by {len(signers)} valid view changes, fewer than a quorum")
        best = self._highest(step, view, changes)
        if best is not None and best.value != value:
            raise ValueError(f"a new view proposing another value than the prepared one of view {best.view}")
        return value

    # ---------------------------------------------------------------------------------------------- the loop
    def decide(self, step: int, propose: Callable[[], bytes], validate: Callable[[bytes], str | None]) -> Decision:
        """Run the step's agreement until a value is decided ([Note: agreement]).

        Args:
            step: the instance (messages of other steps are not read).
            propose: the value this member proposes when it leads a view with nothing prepared before.
            validate: ``None`` when a proposed value is acceptable, else why not (the proposal is then not voted
                for, and the reason kept in :attr:`rejected`).
        """
        views: dict[int, _View] = {}
        prepared: Certificate | None = None  # the highest prepared certificate of this member
        view, entered = 0, time.monotonic()
        while True:
            state = views.setdefault(view, _View())
            if self.membership.leader(step, view) == self.me and not state.proposed:
                value = self._lead(step, view, state, propose)
                if value is not None:
                    state.proposed, state.value = True, value
            if state.value is not None and not state.prepared:
                state.prepared = True
                self._vote(step, view, PREPARE, views)
            if state.prepared and not state.committed:
                cert = self._quorum(step, view, PREPARE, state.value, state.prepares)
                if cert is not None:
                    prepared, state.committed = cert, True
                    self._vote(step, view, COMMIT, views)
            for w, s in views.items():
                cert = self._quorum(step, w, COMMIT, s.value, s.commits)
                if cert is not None:
                    return self._decided(step, Decision(step, w, cert.value, cert), views, validate)
            later = self._later_view(views, view)
            deadline = entered + self.timeout_s * (view + 1)
            if later is not None or time.monotonic() >= deadline:
                view, entered = later if later is not None else view + 1, time.monotonic()
                if view >= self.max_views:
                    raise NoAgreement(
                        f"lightning_zero: rank {self.me} reached no agreement on step {step} in {self.max_views}"
                        f" views ({self.membership.n} members, f={self.membership.f}, first view's timeout"
                        f" {self.timeout_s:g} s): more faulty members than f, or messages slower than the timeout"
                    )
                change = prepared.encode() if prepared is not None else b""
                target = views.setdefault(view, _View())
                target.changes[self.me] = (change, self._broadcast(step, self._phase(view, VIEW_CHANGE), change))
                continue
            for sender, phase, payload, evidence in self.transport.take(step, self.phases, deadline - time.monotonic()):
                decision = self._receive(step, sender, phase, payload, evidence, views, validate)
                if decision is not None:
                    return self._decided(step, decision, views, validate)

    def _lead(self, step: int, view: int, state: _View, propose: Callable[[], bytes]) -> bytes | None:
        """As the leader of ``view``: the pre-prepare sent and its value returned, or ``None`` while a new view still
        lacks a quorum of view changes."""
        if view == 0:
            value = propose()
            self._broadcast(step, self._phase(view, PRE_PREPARE), wire.pack([value]))
            return value
        if len(state.changes) < self.membership.quorum:
            return None
        chosen = sorted(state.changes.items())[: self.membership.quorum]
        best = self._highest(step, view, [payload for _, (payload, _) in chosen])
        value = best.value if best is not None else propose()
        justification = [part for _, (payload, ev) in chosen for part in (payload, wire.pack_evidence(ev))]
        self._broadcast(step, self._phase(view, PRE_PREPARE), wire.pack([value, *justification]))
        return value

    def _quorum(
        self, step: int, view: int, kind: int, value: bytes | None, votes: dict[int, tuple[bytes, Evidence]]
    ) -> Certificate | None:
        """The certificate of ``votes`` for ``value`` when a quorum of them match it."""
        if value is None:
            return None
        digest = wire.sha256(value)
        matching = tuple(ev for _, (d, ev) in sorted(votes.items()) if d == digest)
        if len(matching) < self.membership.quorum:
            return None  # a certificate holds exactly a quorum (the lowest ranks'): its size is known in advance
        return Certificate(step, view, kind, value, matching[: self.membership.quorum])

    def _later_view(self, views: dict[int, _View], view: int) -> int | None:
        """The smallest view above ``view`` that ``f + 1`` members asked for (one of them honest), if any."""
        asked: dict[int, int] = {}  # member -> the highest view it asked for
        for w, s in views.items():
            if w > view:
                for sender in s.changes:
                    asked[sender] = max(asked.get(sender, 0), w)
        if len(asked) < self.membership.f + 1:
            return None
        return sorted(asked.values(), reverse=True)[self.membership.f]

    def _decided(
        self, step: int, decision: Decision, views: dict[int, _View], validate: Callable[[bytes], str | None]
    ) -> Decision:
        """Tell every member (those that missed a message decide on it), read what has already arrived (its
        misbehaviour is kept), then return ``decision``."""
        self._broadcast(step, self.phase_base, decision.certificate.encode())
        for sender, phase, payload, evidence in self.transport.take(step, self.phases, 0.0):
            self._receive(step, sender, phase, payload, evidence, views, validate)
        return decision
