"""The pure bucketing math, without processes."""

import pytest

from lightning_zero.comm.bucketing import assign_buckets


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
