"""The pipeline schedules against their theory: bubble ``(p - 1) / (m + p - 1)``, activations held per stage."""

from __future__ import annotations

import pytest

from lightning_zero.pipeline.schedule import Action, bubble_fraction, build, gpipe, one_f_one_b, simulate

SIZES = [(1, 1), (1, 4), (2, 1), (2, 4), (4, 4), (4, 8), (3, 7), (8, 3)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "micro_batches"), SIZES)
def test_bubble_matches_the_formula(name, stages, micro_batches):
    """Equal forward (and backward) times on every stage: makespan ``(m + p - 1)(f + b)``, every stage idle for
    ``(p - 1) / (m + p - 1)`` of it."""
    timeline = simulate(build(name, stages, micro_batches), forward=1.0, backward=2.0)
    assert timeline.makespan == pytest.approx((micro_batches + stages - 1) * 3.0)
    for bubble in timeline.bubble:
        assert bubble == pytest.approx(bubble_fraction(stages, micro_batches))


@pytest.mark.parametrize(("stages", "micro_batches"), SIZES)
def test_1f1b_holds_fewer_activations_than_gpipe(stages, micro_batches):
    """GPipe holds every micro-batch on every stage; 1F1B at most ``p - s`` on stage ``s``."""
    assert simulate(gpipe(stages, micro_batches)).peak_activations == [micro_batches] * stages
    expected = [min(stages - s, micro_batches) for s in range(stages)]
    assert simulate(one_f_one_b(stages, micro_batches)).peak_activations == expected


def test_1f1b_order_on_four_stages():
    """The last stage alternates from the start; the first warms up with three forwards."""
    schedule = one_f_one_b(4, 5)
    assert [f"{a.kind}{a.micro_batch}" for a in schedule[3]] == [
        "F0",
        "B0",
        "F1",
        "B1",
        "F2",
        "B2",
        "F3",
        "B3",
        "F4",
        "B4",
    ]
    assert [f"{a.kind}{a.micro_batch}" for a in schedule[0]] == [
        "F0",
        "F1",
        "F2",
        "F3",
        "B0",
        "F4",
        "B1",
        "B2",
        "B3",
        "B4",
    ]


def test_a_schedule_that_deadlocks_or_misses_an_action_is_refused():
    """The simulator measures, it does not assume: a wrong order is caught, not timed."""
    wrong = gpipe(2, 2)
    wrong[1] = [Action("B", 0), Action("F", 0), Action("F", 1), Action("B", 1)]  # backward before its forward
    with pytest.raises(ValueError, match="the schedule deadlocks"):
        simulate(wrong)
    missing = gpipe(2, 2)
    missing[0] = missing[0][:-1]
    with pytest.raises(ValueError, match="stage 0 does not run each of the 2 forwards and backwards once"):
        simulate(missing)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("gpipe", 0, 4), "stages=0 is invalid: expected an integer >= 1"),
        (("1f1b", 2, 0), "micro_batches=0 is invalid: expected an integer >= 1"),
        (("zb", 2, 4), "schedule='zb' is invalid: expected one of ('gpipe', '1f1b')"),
    ],
)
def test_bad_sizes_and_names_are_refused(args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build(*args)
