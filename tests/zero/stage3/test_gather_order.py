"""The ZeRO-3 gather-order guard: the pure rules, then real gloo processes driving ``GatherOrder`` directly."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lightning_zero.comm import collectives as comm
from lightning_zero.zero.stage3.gather_order import (
    END,
    GATHER,
    REDUCE,
    GatherOrder,
    code,
    disagreement,
    extend_digest,
    is_planned,
)
from tests.helpers.workers import run_workers

LABELS = ["a", "b", "c", "d"]


def _digest(units: list[int]) -> int:
    digest = 0
    for unit in units:
        digest = extend_digest(digest, unit)
    return digest


def test_digest_depends_on_order_and_length():
    assert _digest([0, 1, 2]) == _digest([0, 1, 2])
    assert len({_digest([0, 1, 2]), _digest([0, 2, 1]), _digest([0, 1]), _digest([0, 1, 2, 2]), _digest([])}) == 5
    assert 0 <= _digest(list(range(1000)) * 3) < 2**63


@pytest.mark.parametrize(
    ("plan", "position", "unit", "expected"),
    [
        ([0, 1, 2], 0, 0, True),
        ([0, 1, 2], 1, 1, True),
        ([0, 1, 2], 1, 2, False),
        ([0, 1], 2, 0, False),
        ([], 0, 0, False),
    ],
)
def test_is_planned(plan, position, unit, expected):
    assert is_planned(plan, position, unit) is expected


def test_disagreement_names_both_sides():
    agree = [[GATHER, 1, 5, 0], [GATHER, 1, 5, 0]]
    assert disagreement(agree, 0, LABELS, []) == ""
    units = [[GATHER, 1, 5, 0], [GATHER, 3, 5, 0]]
    message = disagreement(units, 1, LABELS, [])
    assert "collective sequence diverged" in message
    assert "rank 1 gathers unit 'd' as its collective #5 while rank 0 gathers unit 'b' as its collective #5" in message
    ended = [[GATHER, 2, 7, 0], [END, -1, 7, 123]]
    assert "rank 0 gathers unit 'c' as its collective #7 while rank 1 ended its pass after 7 collectives" in (
        disagreement(ended, 0, LABELS, [])
    )
    assert "rank 1 ended its pass after 7 collectives while rank 0 gathers unit 'c'" in disagreement(
        ended, 1, LABELS, []
    )
    reduces = [[REDUCE, 2, 4, 0], [GATHER, 1, 4, 0]]
    assert (
        "rank 0 reduce-scatters the gradients of unit 'c' as its collective #4 while rank 1 gathers unit 'b'"
        in disagreement(reduces, 0, LABELS, [])
    )


def test_disagreement_at_the_end_of_a_pass_lists_this_ranks_sequence():
    mine = [code(GATHER, 0), code(REDUCE, 1), code(GATHER, 2)]
    ends = [[END, -1, 9, _digest(mine)], [END, -1, 9, _digest(mine[::-1])]]
    message = disagreement(ends, 0, LABELS, mine)
    assert "diverged in the pass that just ended: rank 0 ran [gather 'a', reduce 'b', gather 'c']" in message
    assert "rank 1 ran a different sequence (9 in all)" in message


def _guard_worker(world_size: int, scenario: str) -> dict:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    guard = GatherOrder(LABELS)
    comm.LEDGER.reset()
    blocking_per_pass = []

    def run_pass(units: list[int]) -> None:
        before = comm.LEDGER.calls(tag="gather_check")
        for unit in units:
            guard.before_gather(unit)
        blocking_per_pass.append(comm.LEDGER.calls(tag="gather_check") - before)
        guard.end_pass()

    try:
        run_pass([0, 1, 2, 3, 2, 1])  # no plan yet: every gather is checked
        run_pass([0, 1, 2, 3, 2, 1])  # the plan: nothing to check
        if scenario == "same":
            run_pass([0, 1, 2])  # an evaluation pass: a prefix of the plan
            run_pass([0, 1, 2, 3, 2, 1])  # the plan ran out after 3: the rest is checked
        elif scenario == "deviate":  # rank 1 leaves the plan; rank 0 follows it and ends its pass
            run_pass([0, 1, 2, 3, 2, 1] if rank == 0 else [0, 1, 3, 2, 1])
            run_pass([0])  # rank 0 checks the end of the last pass first
        elif scenario == "shorter":  # every gather planned, but rank 1 stops early: the end exchange catches it
            run_pass([0, 1, 2, 3, 2, 1] if rank == 0 else [0, 1, 2, 3])
            run_pass([0])
    except RuntimeError as error:
        return {"error": str(error), "blocking": blocking_per_pass}
    return {"error": None, "blocking": blocking_per_pass}


@pytest.mark.timeout(120)
def test_planned_gathers_skip_the_exchange_and_unplanned_ones_are_checked():
    results = run_workers(_guard_worker, 2, 2, "same", timeout=90)
    for result in results:
        assert result == {"error": None, "blocking": [6, 0, 0, 3]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("scenario", "expected"),
    [
        (
            "deviate",
            [
                "rank 0 ended its pass after 18 collectives while rank 1 gathers unit 'd' as its collective #14",
                "rank 1 gathers unit 'd' as its collective #14 while rank 0 ended its pass after 18 collectives",
            ],
        ),
        (
            "shorter",
            [
                "ended: rank 0 ran [gather 'a', gather 'b', gather 'c', gather 'd', gather 'c', gather 'b'] in it",
                "diverged in the pass that just ended: rank 1 ran [gather 'a', gather 'b', gather 'c', gather 'd']",
            ],
        ),
    ],
)
def test_ranks_that_leave_the_plan_get_an_error_naming_the_units(scenario, expected):
    results = run_workers(_guard_worker, 2, 2, scenario, timeout=90)
    for rank, result in enumerate(results):
        assert result["error"] is not None and expected[rank] in result["error"], result
