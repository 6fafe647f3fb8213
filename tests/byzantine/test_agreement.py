"""lightning_zero.byzantine.agreement: PBFT per step among threads of one process, each member with its own signed
TCP transport; a faulty member is real code that rewrites, withholds or forges what it sends."""

from __future__ import annotations

import time
from typing import Any

import pytest

from lightning_zero.byzantine import wire
from lightning_zero.byzantine.agreement import (
    COMMIT,
    PRE_PREPARE,
    PREPARE,
    VIEW_CHANGE,
    Agreement,
    Certificate,
    NoAgreement,
    view_phase,
)
from lightning_zero.byzantine.behaviours import Rewrite, Twisted
from lightning_zero.byzantine.membership import Membership
from lightning_zero.comm.signed import verify_evidence
from tests.helpers.byzantine import run_members, silent

pytest.importorskip("cryptography")
TIMEOUT = 1.0  # the first view's deadline: far above a thread's message delay here, even on a loaded machine


def run_agreement(n: int, f: int, steps: int = 1, faulty: dict[int, Rewrite] | None = None) -> dict[Any, Any]:
    """Every member decides steps ``0 .. steps - 1``, proposing ``b"value of <rank>"``: ``{rank: (decisions,
    misbehaviour recorded), or the error raised}``."""
    members = Membership.of(n, f)

    def body(rank: int, link: Any) -> tuple[list, list]:
        agreement = Agreement(link, members, timeout_s=TIMEOUT)
        propose = lambda: f"value of {rank}".encode()  # noqa: E731
        return [agreement.decide(s, propose, lambda value: None) for s in range(steps)], agreement.misbehaviour

    out = run_members(n, body, faulty or {}, linger=1.0)
    for r in range(n):
        if isinstance(out[r], tuple):
            out[r], out[("misbehaviour", r)] = out[r]
    return out


def decided(out: dict[Any, Any], honest: list[int]) -> list[list[bytes]]:
    """Each honest member's decided values, by step (fails on a member that raised)."""
    for r in honest:
        assert isinstance(out[r], list), (r, out[r])
    return [[d.value for d in out[r]] for r in honest]


def test_without_faults_every_member_decides_the_leaders_value_with_a_certificate_anyone_can_check():
    out = run_agreement(4, 1, steps=4)
    values = decided(out, [0, 1, 2, 3])
    assert all(v == [b"value of 0", b"value of 1", b"value of 2", b"value of 3"] for v in values)  # leader rotates
    for rank in range(4):
        for step, decision in enumerate(out[rank]):
            cert = decision.certificate
            assert (decision.view, cert.kind) == (0, COMMIT)
            signers = {e.fields[0] for e in cert.votes if verify_evidence(out["keys"][e.fields[0]], e)}
            assert len(signers) >= Membership.of(4, 1).quorum
            for e in cert.votes:  # each a commit of this step and view for sha256(value)
                assert e.fields[2:4] == (step, view_phase(0, COMMIT))
                assert e.digest == wire.sha256(wire.sha256(decision.value))
    assert not any(out[("misbehaviour", r)] for r in range(4))


def test_a_silent_leader_is_replaced_by_a_view_change():
    start = time.monotonic()
    out = run_agreement(4, 1, steps=2, faulty={1: silent})  # rank 1 leads step 1's view 0
    values = decided(out, [0, 2, 3])
    assert values == [[b"value of 0", b"value of 2"]] * 3  # step 1: view 1's leader, rank 2
    assert [out[r][1].view for r in (0, 2, 3)] == [1, 1, 1]
    assert time.monotonic() - start < 60


def _equivocating_leader(group_b: set[int], vote_both: bool = True) -> Rewrite:
    """As step 0's leader: value A to most members, value B to ``group_b``; its votes follow what each peer got."""

    def rewrite(link: Twisted, peer: int, step: int, phase: int, payload: bytes) -> bytes | None:
        if peer not in group_b:
            return payload
        if phase == view_phase(0, PRE_PREPARE):
            return wire.pack([b"B"])
        if phase in (view_phase(0, PREPARE), view_phase(0, COMMIT)) and vote_both:
            return wire.sha256(b"B")
        return payload

    return rewrite


@pytest.mark.parametrize(("n", "f", "faulty", "group_b"), [(4, 1, {0}, {3}), (7, 2, {0, 1}, {5, 6})])
def test_an_equivocating_leader_and_its_accomplices_never_split_the_honest_members(n, f, faulty, group_b):
    out = run_agreement(n, f, faulty={r: _equivocating_leader(group_b) for r in faulty})
    honest = [r for r in range(n) if r not in faulty]
    values = decided(out, honest)
    assert all(v == values[0] for v in values), values  # safety: one value for the step
    assert values[0] in ([b"value of 0"], [f"value of {min(honest)}".encode()])


def test_a_malformed_proposal_is_kept_as_proof_of_its_leader_and_the_next_view_decides():
    """Rank 0 leads view 0 with bytes that do not parse and sends garbage votes: every member must read the
    pre-prepare it waits for, so each keeps the signed proof; view 1 (rank 1) decides."""

    def garbage(link: Twisted, peer: int, step: int, phase: int, payload: bytes) -> bytes | None:
        if phase == view_phase(0, PRE_PREPARE):
            return b"\xff" * 7
        return b"12345" if phase in (view_phase(0, PREPARE), view_phase(0, COMMIT)) else payload

    out = run_agreement(4, 1, faulty={0: garbage})
    assert decided(out, [1, 2, 3]) == [[b"value of 1"]] * 3
    for r in (1, 2, 3):
        proofs = [p for p in out[("misbehaviour", r)] if p.evidence.fields[3] == view_phase(0, PRE_PREPARE)]
        assert len(proofs) == 1 and proofs[0].rank == 0 and "a part announcing 4294967295 bytes" in proofs[0].reason
        assert verify_evidence(out["keys"][0], proofs[0].evidence)  # signed by rank 0: transferable
        assert all(p.rank == 0 for p in out[("misbehaviour", r)])


@pytest.mark.slow
def test_more_silent_members_than_f_end_in_no_agreement_on_every_honest_member_not_a_hang():
    start = time.monotonic()
    out = run_agreement(4, 1, faulty={0: silent, 1: silent})
    for r in (2, 3):
        assert isinstance(out[r], NoAgreement), out[r]
        assert "reached no agreement on step 0 in 4 views (4 members, f=1" in str(out[r])
    assert time.monotonic() - start < 40  # 1 s x (1 + 2 + 3 + 4) and the teardown


def test_a_forged_certificate_in_a_view_change_is_refused_and_kept_as_proof():
    """Rank 0 leads view 0 and sends nothing, then claims in its view change a prepared value whose votes it signed
    alone. View 1's leader (rank 1) must not count it: it proposes its own value."""

    def forger(link: Twisted, peer: int, step: int, phase: int, payload: bytes) -> bytes | None:
        if phase in range(view_phase(0, PRE_PREPARE), view_phase(1, PRE_PREPARE)):
            return None
        if phase != view_phase(1, VIEW_CHANGE):
            return payload
        vote = link.sign_own(0, view_phase(0, PREPARE), wire.sha256(b"forged"))
        return Certificate(0, 0, PREPARE, b"forged", (vote, vote, vote)).encode()

    out = run_agreement(4, 1, faulty={0: forger})
    assert decided(out, [1, 2, 3]) == [[b"value of 1"]] * 3
    proofs = [p for r in (1, 2, 3) for p in out[("misbehaviour", r)]]
    assert proofs and all(p.rank == 0 and "1 valid votes, fewer than a quorum" in p.reason for p in proofs)


def test_a_value_prepared_before_a_view_change_is_the_one_the_next_leader_proposes():
    """Rank 0 leads view 0 and lets only rank 2 prepare its value A (pre-prepare to ranks 1 and 2, its prepare to
    rank 2, no commit). No one decides in view 0; rank 2's view change carries A's certificate, and view 1's leader
    (rank 1) must propose A, not its own value: a value some honest member may have decided on is never replaced."""

    def partial(link: Twisted, peer: int, step: int, phase: int, payload: bytes) -> bytes | None:
        if phase == view_phase(0, PRE_PREPARE):
            return payload if peer in (1, 2) else None
        if phase == view_phase(0, PREPARE):
            return payload if peer == 2 else None
        return None if phase == view_phase(0, COMMIT) else payload

    out = run_agreement(4, 1, faulty={0: partial})
    assert decided(out, [1, 2, 3]) == [[b"value of 0"]] * 3
    assert [out[r][0].view for r in (1, 2, 3)] == [1, 1, 1]
