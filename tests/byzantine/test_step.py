"""lightning_zero.byzantine.step: one step among threads of one process, each member with its own signed TCP
transport; faulty members run real attack code. Honest members must end with the same bits, equal to the rule on
the whole stack, and hold the proofs."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from lightning_zero.byzantine.behaviours import BEHAVIOURS, Crashed, Rewrite, Twisted
from lightning_zero.byzantine.inputs import ECHO, INPUT
from lightning_zero.byzantine.membership import Membership
from lightning_zero.byzantine.step import StepProtocol
from lightning_zero.robust.aggregation import RobustAggregator
from tests.helpers.byzantine import run_members, silent

pytest.importorskip("cryptography")
K, D, TIMEOUT = 2, 37, 2.0
MEMBERS = Membership.of(4, 1)
RULES = {"median": {}, "trimmed_mean": {}, "centered_clipping": {"tau": 0.5, "iterations": 3}}


def rows_of(rank: int) -> torch.Tensor:
    return torch.randn(K, D, generator=torch.Generator().manual_seed(100 + rank))


def aggregator(rule: str, n: int, f: int) -> RobustAggregator:
    agg = RobustAggregator(rule, f=f, rule_kwargs=RULES[rule])
    agg.validate(n * K)
    return agg


def run_step(
    n: int, f: int, rule: str, faulty: dict[int, Rewrite] | None = None, wrong: set[int] = frozenset(),
    steps: int = 1,
) -> dict[Any, Any]:  # fmt: skip
    """Every member runs steps ``0 .. steps - 1`` with its rows; ``faulty``: rewrites of a member's sends;
    ``wrong``: members whose shard results are off by one. ``{rank: Outcome (the list of them for several steps) or
    error}``."""
    members = Membership.of(n, f)

    def body(rank: int, link: Any) -> Any:
        protocol = StepProtocol(link, members, timeout_s=TIMEOUT)
        outcomes = []
        for step in range(steps):
            rounds = [aggregator(rule, n, f) for _ in protocol.membership.shards_of(rank)]

            def aggregate(j, stack, shard, rounds=rounds):
                vector = rounds[j](stack, shard).vector
                return vector + 1 if rank in wrong else vector

            outcomes.append(protocol.run(step, rows_of(rank), aggregate))
        return outcomes[0] if steps == 1 else outcomes

    return run_members(n, body, faulty or {}, linger=1.0)


def reference(rule: str, n: int, f: int, left_out: set[int] = frozenset()) -> torch.Tensor:
    """The rule on the whole stack, unsharded, a left-out member's rows NaN."""
    stack = torch.cat([torch.full((K, D), float("nan")) if r in left_out else rows_of(r) for r in range(n)])
    return aggregator(rule, n, f)(stack).vector


def check_honest(out: dict[Any, Any], honest: list[int], rule: str, n: int, f: int, left_out: set[int]) -> None:
    for r in honest:
        assert not isinstance(out[r], Exception), (r, out[r])
    first = out[honest[0]].vector
    for r in honest:
        assert torch.equal(out[r].vector, first), r  # safety: the same bits on every honest member
        assert set(out[r].included) == set(range(n)) - left_out, (r, out[r].included)
    torch.testing.assert_close(first, reference(rule, n, f, left_out), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rule", list(RULES))
def test_without_faults_the_aggregate_is_the_rule_on_the_whole_stack_on_every_member(rule):
    out = run_step(4, 1, rule)
    check_honest(out, [0, 1, 2, 3], rule, 4, 1, set())
    assert not any(out[r].proofs or out[r].silent for r in range(4))


def test_equivocating_inputs_are_proven_and_left_out_on_every_honest_member():
    out = run_step(4, 1, "median", faulty={3: BEHAVIOURS["equivocate"](MEMBERS, TIMEOUT)})
    check_honest(out, [0, 1, 2], "median", 4, 1, {3})
    for r in (0, 1, 2):
        assert out[r].proofs[3].kind == "equivocation"


def test_a_forged_digest_is_proven_by_its_victim_spread_by_the_echo_and_evicts_the_forger():
    """Rank 0, step 0's leader, forges to rank 1. Rank 1's echo carries the proof: every member checks it, leaves
    rank 0 out and agrees to evict it, rank 0's own (honest) code included."""
    out = run_step(4, 1, "trimmed_mean", faulty={0: BEHAVIOURS["forged_digest"](MEMBERS, TIMEOUT)})  # to rank 1
    check_honest(out, [1, 2, 3], "trimmed_mean", 4, 1, {0})
    for r in (1, 2, 3):
        assert out[r].proofs[0].kind == "forged_digest" and out[r].evicted == (0,)


@pytest.mark.parametrize("rule", ["median", "centered_clipping"])
def test_a_wrong_shard_result_is_outvoted_and_proven(rule):
    out = run_step(4, 1, rule, wrong={2})
    check_honest(out, [0, 1, 3], rule, 4, 1, set())
    for r in (0, 1, 3):
        assert out[r].proofs[2].kind == "wrong_aggregate"


def test_a_silent_member_is_left_out_and_named_and_the_others_agree():
    out = run_step(4, 1, "centered_clipping", faulty={0: silent})
    check_honest(out, [1, 2, 3], "centered_clipping", 4, 1, {0})
    assert all(out[r].silent == {0} for r in (1, 2, 3))


def test_a_wrong_partial_sum_cannot_bend_the_totals():
    """Rank 1 corrupts every partial sum it sends (centered clipping's norms): the f + 1 honest copies win."""

    out = run_step(4, 1, "centered_clipping", faulty={1: BEHAVIOURS["wrong_partial"](MEMBERS, TIMEOUT)})
    check_honest(out, [0, 2, 3], "centered_clipping", 4, 1, set())
    assert all(out[r].proofs[1].kind == "wrong_aggregate" for r in (0, 2, 3))


@pytest.mark.parametrize("late", [0.0, 0.25], ids=["on-time", "late-echo"])
def test_columns_withheld_from_one_member_are_recovered_from_their_holders(late):
    """Rank 3 sends rank 1 no input at all: no proof, but f + 1 aggregators of every shard hold its columns, so step
    0's leader includes it, and rank 1 asks the holders for what it lacks. Rank 1 waited a whole timeout for that
    input, so its echo comes a timeout after the others'; ``late-echo`` delays it by a quarter timeout more (a slow
    honest member): the others must still wait for it ([Note: rounds] in lightning_zero/byzantine/step.py)."""

    def withhold(link: Twisted, peer: int, step: int, phase: int, payload: bytes) -> bytes | None:
        return None if (phase, peer) == (INPUT, 1) else payload

    def slow(link: Twisted, peer: int, step: int, phase: int, payload: bytes) -> bytes:
        if (phase, peer) == (ECHO, 0):  # the first echo it sends: every later one waits behind it
            time.sleep(late * TIMEOUT)
        return payload

    out = run_step(4, 1, "median", faulty={3: withhold, 1: slow})
    check_honest(out, [0, 1, 2], "median", 4, 1, set())
    assert not any(out[r].proofs or out[r].silent for r in (0, 2))
    assert out[1].silent == {3}


def test_an_equivocating_member_is_evicted_after_the_step_that_proves_it_and_the_rest_trains_on():
    out = run_step(4, 1, "median", faulty={3: BEHAVIOURS["equivocate"](MEMBERS, TIMEOUT)}, steps=3)
    for r in (0, 1, 2):
        first, *later = out[r]
        assert first.evicted == (3,) and first.proofs[3].kind == "equivocation"
        assert all(o.included == (0, 1, 2) and o.evicted == () for o in later)
        assert all(torch.equal(o.vector, out[0][i].vector) for i, o in enumerate(out[r]))
    torch.testing.assert_close(out[0][2].vector, reference("median", 4, 1, {3}), rtol=1e-6, atol=1e-6)


def test_a_member_left_out_f_plus_1_steps_in_a_row_is_evicted():
    out = run_step(4, 1, "median", faulty={2: silent}, steps=3)
    for r in (0, 1, 3):
        assert [o.included for o in out[r]] == [(0, 1, 3)] * 3
        assert [o.evicted for o in out[r]] == [(), (2,), ()]  # evict_after = f + 1 = 2 steps
        assert out[r][2].silent == set()  # no one waits for rank 2 any more


def check_left_out_then_evicted(out: dict[Any, Any], faulty: int, first: int) -> None:
    """The honest members agree on every step, leave ``faulty`` out from step ``first`` and evict it f + 1 = 2 steps
    later."""
    honest = [r for r in range(4) if r != faulty]
    rest = tuple(honest)
    for r in honest:
        assert [o.included for o in out[r]] == [(0, 1, 2, 3)] * first + [rest] * (3 - first), r
        assert [o.evicted for o in out[r]] == [(faulty,) if i == first + 1 else () for i in range(3)], r
        assert all(torch.equal(o.vector, out[honest[0]][i].vector) for i, o in enumerate(out[r]))
        assert not any(o.proofs for o in out[r])  # leaving is no proof


def test_a_crashed_member_is_left_out_then_evicted_and_the_others_train_on():
    """Rank 3's connections drop at step 1 (behaviour ``crash``): left out of steps 1 and 2, evicted after step 2."""
    out = run_step(4, 1, "median", faulty={3: BEHAVIOURS["crash"](MEMBERS, TIMEOUT)}, steps=3)
    assert isinstance(out[3], Crashed)
    check_left_out_then_evicted(out, 3, first=1)


@pytest.mark.slow
def test_a_straggler_inside_the_timeout_is_waited_for_and_one_past_it_is_left_out_then_evicted():
    """Each step's first message of rank 2 comes 0.8 timeouts late (``slow_under``): every step waits for it. At 1.25
    timeouts (``slow_over``) it is silent from step 0 on, and evicted after step 1."""
    under = run_step(4, 1, "median", faulty={2: BEHAVIOURS["slow_under"](MEMBERS, TIMEOUT)}, steps=2)
    for r in (0, 1, 3):
        assert [(o.included, o.silent, o.evicted) for o in under[r]] == [((0, 1, 2, 3), set(), ())] * 2, r
        assert all(torch.equal(o.vector, under[0][i].vector) for i, o in enumerate(under[r]))
    over = run_step(4, 1, "median", faulty={2: BEHAVIOURS["slow_over"](MEMBERS, TIMEOUT)}, steps=3)
    check_left_out_then_evicted(over, 2, first=0)
