"""The pure bucketing math, without processes."""

import pytest

from lightning_zero.comm.bucketing import assign_buckets, buckets_by_arrival


def _members(layouts):
    return [list(b.indices) for b in layouts]


def test_fills_buckets_in_order_up_to_the_cap():
    layouts = assign_buckets([10, 10, 10, 10, 10], [4] * 5, ["f32"] * 5, cap_bytes=80)
    assert _members(layouts) == [[0, 1], [2, 3], [4]]
    assert [b.offsets for b in layouts] == [(0, 10), (0, 10), (0,)]
    assert [b.numel for b in layouts] == [20, 20, 10]


def test_oversized_tensor_gets_its_own_bucket():
    layouts = assign_buckets([5, 1000, 5], [4] * 3, ["k"] * 3, cap_bytes=100)
    assert _members(layouts) == [[0], [1], [2]]


def test_keys_never_share_a_bucket_and_keep_separate_open_buckets():
    keys = ["f32", "bf16", "f32", "bf16"]
    layouts = assign_buckets([4, 4, 4, 4], [4, 2, 4, 2], keys, cap_bytes=1 << 20)
    assert _members(layouts) == [[0, 2], [1, 3]]
    assert [b.key for b in layouts] == ["f32", "bf16"]


def test_every_tensor_is_placed_once_with_contiguous_offsets():
    numels = [7, 1, 300, 2, 2, 50, 9]
    layouts = assign_buckets(numels, [4] * len(numels), [0] * len(numels), cap_bytes=256)
    placed = sorted(i for b in layouts for i in b.indices)
    assert placed == list(range(len(numels)))
    for b in layouts:
        ends = [o + numels[i] for i, o in zip(b.indices, b.offsets)]
        assert list(b.offsets[1:]) == ends[:-1]
        assert ends[-1] == b.numel


def test_empty_input_gives_no_buckets():
    assert assign_buckets([], [], [], cap_bytes=10) == []


@pytest.mark.parametrize("cap", [0, -5])
def test_non_positive_cap_is_rejected_with_the_number(cap):
    with pytest.raises(ValueError, match=f"cap_bytes={cap} is invalid"):
        assign_buckets([1], [4], [0], cap_bytes=cap)


def test_mismatched_lengths_are_rejected():
    with pytest.raises(ValueError, match="one entry per tensor"):
        assign_buckets([1, 2], [4], [0, 0], cap_bytes=10)


# ------------------------------------------------------------------------------------ the rebuild by arrival
def _torchs_rebuilt(order, numels, dtypes, first_cap, cap):
    """Torch DDP's own rebuild: ``compute_bucket_assignment_by_size`` over the tensors in arrival order, with their
    indices (as its ``Reducer::rebuild_buckets`` calls it)."""
    import torch
    import torch.distributed as dist

    tensors = [torch.empty(numels[i], dtype=dtypes[i]) for i in order]
    indices, _ = dist._compute_bucket_assignment_by_size(tensors, [first_cap, cap], [False] * len(order), list(order))
    return indices


@pytest.mark.parametrize("seed", range(20))
def test_rebuild_by_arrival_is_torchs_rule(seed):
    import random

    import torch

    rng = random.Random(seed)
    n = rng.randint(1, 30)
    numels = [rng.choice([1, 10, 1000, 50_000, 300_000, 2_000_000]) for _ in range(n)]
    order = list(range(n))
    rng.shuffle(order)
    first_cap, cap = rng.choice([(2**20, 25 * 2**20), (2**20, 2**20), (40_000, 4 * 2**20), (3, 3)])
    dtypes = [torch.float32] * n
    ours = buckets_by_arrival(order, numels, [4] * n, ["f32"] * n, first_cap, cap)
    assert [list(b.indices) for b in ours] == _torchs_rebuilt(order, numels, dtypes, first_cap, cap)


def test_rebuild_by_arrival_with_two_dtypes_has_torchs_buckets():
    """Per key its own caps (the first bucket of each dtype small); torch's buckets, in closing order."""
    import torch

    numels = [300_000, 10, 300_000, 200_000, 50, 5]
    dtypes = [torch.float32, torch.float64, torch.float32, torch.float64, torch.float32, torch.float64]
    order = [2, 0, 4, 1, 3, 5]
    keys = [str(d) for d in dtypes]
    sizes = [torch.empty((), dtype=d).element_size() for d in dtypes]
    ours = buckets_by_arrival(order, numels, sizes, keys, 2**20, 25 * 2**20)
    torchs = _torchs_rebuilt(order, numels, dtypes, 2**20, 25 * 2**20)
    assert sorted(map(sorted, torchs)) == sorted(sorted(b.indices) for b in ours)
    assert [list(b.indices) for b in ours][:2] == torchs[:2]  # the closed ones, in closing order
    assert [b.key for b in ours] == ["torch.float32", "torch.float64", "torch.float32", "torch.float64"]


def test_rebuilt_offsets_follow_arrival_order():
    layouts = buckets_by_arrival([2, 0, 1], [5, 7, 3], [4] * 3, [0] * 3, first_cap_bytes=1000, cap_bytes=1000)
    assert [(b.indices, b.offsets, b.numel) for b in layouts] == [((2, 0, 1), (0, 3, 8), 15)]


@pytest.mark.parametrize(
    ("order", "caps", "message"),
    [
        ([0, 0], (10, 10), r"order must list every tensor index 0..1 once: got \[0, 0\]"),
        ([0, 1], (0, 10), "first_cap_bytes=0 is invalid"),
        ([0, 1], (10, -1), "cap_bytes=-1 is invalid"),
    ],
)
def test_rebuild_by_arrival_refuses_bad_input(order, caps, message):
    with pytest.raises(ValueError, match=message):
        buckets_by_arrival(order, [1, 1], [4, 4], [0, 0], *caps)
