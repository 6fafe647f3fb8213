"""lightning_zero.byzantine.membership: the counting of [Note: counting], checked by enumeration (no processes)."""

from __future__ import annotations

import itertools

import pytest

from lightning_zero.byzantine.membership import Membership, check_f


@pytest.mark.parametrize(("n", "f"), [(4, 1), (5, 1), (7, 2), (8, 2), (10, 3), (13, 4)])
def test_two_quorums_share_an_honest_member_and_the_honest_alone_are_a_quorum(n, f):
    members = Membership.of(n, f)
    q = members.quorum
    assert n - f >= q  # liveness: the faulty ones cannot block a quorum by silence
    assert 2 * q - n >= f + 1  # safety: the smallest overlap of two quorums holds f + 1 members
    if n == 3 * f + 1:
        assert q == 2 * f + 1
    assert members.acceptance == f + 1 and members.aggregators_per_shard == 2 * f + 1


@pytest.mark.parametrize(("n", "f"), [(4, 1), (7, 2), (9, 2)])
def test_every_shard_has_2f_plus_1_distinct_aggregators_and_each_member_as_many_shards(n, f):
    members = Membership.of(n, f)
    per_member = {r: [] for r in range(n)}
    for shard in range(n):
        aggregators = members.aggregators(shard)
        assert len(set(aggregators)) == 2 * f + 1 and aggregators[0] == shard
        for r in aggregators:
            per_member[r].append(shard)
    for r in range(n):
        assert sorted(members.shards_of(r)) == sorted(per_member[r])
        assert all(r in members.aggregators(s) for s in members.shards_of(r))


def test_any_f_faulty_aggregators_leave_f_plus_1_honest_ones_per_shard():
    members = Membership.of(7, 2)
    for faulty in itertools.combinations(range(7), 2):
        for shard in range(7):
            honest = [r for r in members.aggregators(shard) if r not in faulty]
            assert len(honest) >= members.acceptance == 3


def test_the_leader_rotates_with_the_step_and_the_view():
    members = Membership.of(4, 1)
    assert [members.leader(s, 0) for s in range(5)] == [0, 1, 2, 3, 0]
    assert [members.leader(2, v) for v in range(4)] == [2, 3, 0, 1]


def test_an_eviction_lowers_n_and_f_and_renumbers_shards_over_the_members():
    members = Membership.of(7, 2).without(4)
    assert members.members == (0, 1, 2, 3, 5, 6) and members.f == 1 and members.quorum == 4
    assert members.aggregators(4) == (5, 6, 0)  # position 4 is rank 5
    assert members.shards_of(5) == (4, 3, 2)
    assert members.leader(4, 0) == 5
    assert Membership.of(4, 1).without(0).f == 0


@pytest.mark.parametrize(
    ("world", "f", "message"),
    [
        (3, 1, r"byzantine_ranks=1 needs at least 3f \+ 1 = 4 processes, got 3: .* the largest f for 3 processes is 0"),
        (6, 2, r"byzantine_ranks=2 needs at least 3f \+ 1 = 7 processes, got 6: .* the largest f for 6 processes is 1"),
        (4, 0, r"byzantine_ranks=0 is invalid: expected an integer >= 1"),
        (4, True, r"byzantine_ranks=True is invalid"),
        (4, "1", r"byzantine_ranks='1' is invalid"),
    ],
)
def test_too_few_processes_or_a_bad_f_is_refused_with_the_numbers(world, f, message):
    with pytest.raises(ValueError, match=message):
        check_f(f, world)
    with pytest.raises(ValueError, match=message):
        Membership.of(world, f)


def test_members_must_be_distinct_and_sorted_and_a_stranger_is_named():
    with pytest.raises(ValueError, match=r"members=\(1, 0, 2, 3\) is invalid"):
        Membership((1, 0, 2, 3), 1)
    with pytest.raises(ValueError, match=r"rank 9 is not a member: members are \[0, 1, 2, 3\]"):
        Membership.of(4, 1).shards_of(9)
    with pytest.raises(ValueError, match=r"shard=4 is invalid: expected 0 <= shard < n=4"):
        Membership.of(4, 1).aggregators(4)
