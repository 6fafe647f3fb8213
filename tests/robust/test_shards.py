"""The robust pipeline on column shards equals the unsharded one, without processes: each rank is a thread holding
its columns, and ``total`` adds every thread's partial sums ([Note: sharded aggregation] in
``lightning_zero/robust/shards.py``). The multi-process path (the all-to-all, the rounds, the digests) is in
``tests/robust/test_sharded_engine.py``."""

from __future__ import annotations

import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lightning_zero.robust.aggregation import AggregationResult, RobustAggregator
from lightning_zero.robust.aggregators import RULES
from lightning_zero.robust.attacks import ATTACKS
from lightning_zero.robust.shards import (
    ColumnLayout,
    ColumnShard,
    aggregating_ranks,
    check_replicas,
    column_ranges,
    round_shards,
)
from lightning_zero.zero.partition import flat_layout

N, F = 8, 1
ATTACK_KWARGS = {
    "sign_flip": {"scale": 3.0}, "gaussian": {"std": 2.0}, "alie": {"z": 1.5}, "ipm": {"eps": 2.0}, "mimic": {},
    "nan": {}, "inf": {}, "label_flip": {"num_classes": 3},
}  # fmt: skip
RULE_KWARGS = {"centered_clipping": {"tau": 0.5}, "geometric_median": {"iterations": 4}, "multi_krum": {"m": 4}}
PRE = {"none": [], "nnm": ["nnm"], "bucketing": [{"name": "bucketing", "s": 2}], "clip": [{"name": "clip", "c": 2.0}]}


# ------------------------------------------------------------------------------------------------ the pure math
def test_column_ranges_are_zero_partitions_clipped_to_the_width():
    assert column_ranges(10, 3) == {0: (0, 4), 1: (4, 8), 2: (8, 10)}
    assert column_ranges(5, 4) == {0: (0, 2), 1: (2, 4), 2: (4, 5), 3: (5, 5)}  # an empty last shard
    assert column_ranges(6, 1) == {0: (0, 6)}
    for width, world in [(1, 3), (7, 2), (100, 7), (0, 2)]:
        ranges = column_ranges(width, world)
        covered = [c for lo, hi in ranges.values() for c in range(lo, hi)]
        assert covered == list(range(width))


def test_rounds_cover_every_shard_once_and_each_shard_has_distinct_ranks():
    for world in (2, 3, 5):
        for replicas in range(1, world + 1):
            for j in range(replicas):  # round j: a permutation of the shards
                assert sorted(round_shards(q, world, replicas)[j] for q in range(world)) == list(range(world))
            for s in range(world):
                ranks = aggregating_ranks(s, world, replicas)
                assert len(set(ranks)) == replicas
                assert all(round_shards(q, world, replicas)[j] == s for j, q in enumerate(ranks))


@pytest.mark.parametrize(
    ("replicas", "world", "message"),
    [(0, 2, "expected an integer >= 1"), (3, 2, r"for 2 processes.*\[1, 2\]"), (True, 2, ">= 1"), (1.5, None, ">= 1")],
)
def test_bad_replicas_name_the_setting_and_the_range(replicas, world, message):
    with pytest.raises(ValueError, match=f"aggregation_replicas={replicas!r} is invalid.*{message}"):
        check_replicas(replicas, world)


# ------------------------------------------------------------------------------------------------ threads as ranks
def _run_sharded(make, stacks: list[torch.Tensor], layout: ColumnLayout) -> list[list[AggregationResult]]:
    """``len(stacks)`` steps on the layout's thread-ranks, each with its own aggregator; per step and rank the
    result."""
    world = layout.world_size
    barrier = threading.Barrier(world)
    slots: list = [None] * world

    def rank_main(rank: int) -> list[AggregationResult]:
        def total(partial: torch.Tensor) -> torch.Tensor:
            slots[rank] = partial.clone()
            barrier.wait()
            out = torch.stack(slots).sum(dim=0)
            barrier.wait()
            return out

        aggregator = make()
        shard = ColumnShard(rank, layout.shards[rank], layout.width, total=total)
        return [aggregator(shard.take(stack), shard) for stack in stacks]

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(rank_main, range(world)))


def _assert_sharded_equals_unsharded(make, world: int, steps: int = 2, width: int = 11, layout=None) -> None:
    layout = layout or ColumnLayout.contiguous(width, world)
    generator = torch.Generator().manual_seed(world * 100 + layout.width)
    stacks = [torch.randn(N, layout.width, generator=generator) + 0.3 for _ in range(steps)]
    unsharded = make()
    expected = [unsharded(stack) for stack in stacks]
    per_rank = _run_sharded(make, stacks, layout)
    for step, want in enumerate(expected):
        got = torch.empty_like(want.vector)
        for r in range(world):
            layout.put(got, r, per_rank[r][step].vector)
        torch.testing.assert_close(got, want.vector, rtol=1e-5, atol=1e-6, equal_nan=True)
        for r in range(world):
            result = per_rank[r][step]
            assert result.dropped == want.dropped
            assert result.byzantine_selected == want.byzantine_selected
            assert result.honest_distance == pytest.approx(want.honest_distance, rel=1e-5, abs=1e-6, nan_ok=True)


def _maker(rule: str, pre: str = "none", attack: str | None = None):
    def make() -> RobustAggregator:
        aggregator = RobustAggregator(
            rule, F, RULE_KWARGS.get(rule), PRE[pre], attack, ATTACK_KWARGS.get(attack), seed=7
        )
        aggregator.validate(N)
        return aggregator

    return make


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("attack", [None, *ATTACKS])
@pytest.mark.parametrize("rule", list(RULES))
def test_every_rule_under_every_attack_equals_the_unsharded_pipeline(rule, attack, world):
    _assert_sharded_equals_unsharded(_maker(rule, attack=attack), world)


def _accepted(rule: str, pre: str) -> bool:
    """Whether the pipeline validates for n = 8 (Krum, Multi-Krum and Bulyan refuse the 4 buckets of bucketing)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the mean with f > 0
        try:
            _maker(rule, pre)()
        except ValueError:
            return False
    return True


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    ("rule", "pre"), [(rule, pre) for rule in RULES for pre in ("nnm", "bucketing", "clip") if _accepted(rule, pre)]
)
def test_every_pre_aggregator_before_every_rule_equals_the_unsharded_pipeline(rule, pre, world):
    _assert_sharded_equals_unsharded(_maker(rule, pre, attack="gaussian"), world)


def test_an_empty_shard_takes_part_in_the_totals():
    """5 columns over 4 ranks: the last holds none (2, 2, 1, 0) and still adds zeros to every total."""
    _assert_sharded_equals_unsharded(_maker("krum", "nnm", "sign_flip"), world=4, width=5)
    _assert_sharded_equals_unsharded(_maker("centered_clipping", "clip", "nan"), world=4, width=5)


def test_the_centre_is_kept_per_column_and_the_generator_advances_alike():
    make = _maker("centered_clipping", "bucketing", "gaussian")
    stacks = [torch.randn(N, 9, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    per_rank = _run_sharded(make, stacks, ColumnLayout.contiguous(9, 3))
    unsharded = make()
    for step, stack in enumerate(stacks):
        want = unsharded(stack)
        torch.testing.assert_close(torch.cat([per_rank[r][step].vector for r in range(3)]), want.vector)
    # the unsharded centre is the whole last aggregate
    torch.testing.assert_close(unsharded.center, want.vector)


# ------------------------------------------------------------------------------------------------ ZeRO's shards
def test_the_shards_of_zero_groups_are_each_groups_flat_ranges_in_the_vectors_columns():
    # parameters of 3, 4, 2, 5 elements; two param groups interleaved: {0, 2} and {1, 3}
    numels, groups = [3, 4, 2, 5], [[0, 2], [1, 3]]
    layout = ColumnLayout.of_groups(numels, groups, 2)
    # group {0, 2}: flat [p0 (cols 0-2) | p2 (cols 7-8)], 5 elements, shards of 3: rank 0 cols 0-2, rank 1 cols 7-8
    # group {1, 3}: flat [p1 (cols 3-6) | p3 (cols 9-13)], 9 elements, shards of 5: rank 0 cols 3-7, rank 1 cols 10-13
    # rank 0's p0 and p1 are adjacent columns: one range
    assert layout.shards == (((0, 7), (9, 10)), ((7, 9), (10, 14)))
    assert layout.size(0) + layout.size(1) == 14
    vector = torch.arange(14.0)
    for rank in range(2):  # a rank's values are its ZeRO shard of every group, group after group, padding dropped
        want = []
        for group in groups:
            flat = torch.cat([vector[sum(numels[:i]) : sum(numels[: i + 1])] for i in group])
            lo, hi = flat_layout([numels[i] for i in group], 2).shard_range(rank)
            want.append(flat[lo : min(hi, flat.numel())])
        assert torch.equal(layout.take(vector, rank), torch.cat(want))
    assert ColumnLayout.of_groups([6], [[0]], 3) == ColumnLayout.contiguous(6, 3)


@pytest.mark.parametrize("rule", ["krum", "centered_clipping", "geometric_median", "bulyan"])
def test_a_layout_of_several_ranges_per_shard_equals_the_unsharded_pipeline(rule):
    layout = ColumnLayout.of_groups([3, 4, 2, 5, 1], [[0, 2, 4], [1, 3]], 3)
    assert max(len(ranges) for ranges in layout.shards) > 1
    _assert_sharded_equals_unsharded(_maker(rule, "nnm", "gaussian"), 3, layout=layout)
