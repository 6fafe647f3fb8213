"""worker_shards and WorkerBatchSampler: which samples each global worker sees, whatever the process layout.

Checked: shards partition ``range(N)`` (disjoint, covering, sizes differing by at most one), the ``iid`` split is
seeded, ``label_sorted`` shards carry non-decreasing labels across workers, and the splits' errors;
``WorkerBatchSampler`` batches are their workers' per-worker chunks concatenated in worker order, ``len`` is
``min shard size // batch_per_worker`` on every rank, a global worker sees the same indices in a 2-rank and a 1-rank
layout, ``set_epoch`` reshuffles reproducibly (reached through ``sampler.sampler``), ``shuffle=False`` keeps shard
order, and the constructor's errors.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_zero.robust.sampling import SPLITS, WorkerBatchSampler, worker_shards


def _labels(n: int, classes: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(seed))


def _split_kwargs(split: str, n: int) -> dict:
    return {"split": split, "labels": _labels(n)} if split == "label_sorted" else {"split": split}


# --- worker_shards --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize(("n", "w"), [(23, 5), (16, 8), (7, 7), (100, 3), (5, 1)])
def test_shards_partition_the_samples(split, n, w):
    shards = worker_shards(n, w, **_split_kwargs(split, n))
    assert len(shards) == w
    flat = [i for s in shards for i in s]
    assert len(flat) == n  # disjoint (no index twice) ...
    assert sorted(flat) == list(range(n))  # ... and covering
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    assert min(sizes) == n // w
    assert sum(len(s) == n // w + 1 for s in shards) == n % w
    assert all(isinstance(i, int) for i in flat)


def test_iid_shards_are_seeded():
    n, w = 40, 4
    a = worker_shards(n, w, seed=7)
    assert a == worker_shards(n, w, seed=7)
    assert a != worker_shards(n, w, seed=8)
    assert worker_shards(n, w) == worker_shards(n, w, seed=0)  # the default seed
    # the deal is the seeded permutation, cut into contiguous pieces
    order = torch.randperm(n, generator=torch.Generator().manual_seed(7)).tolist()
    assert [i for s in a for i in s] == order


def test_iid_shards_are_not_sorted():
    shards = worker_shards(50, 5, seed=0)
    assert [i for s in shards for i in s] != list(range(50))


@pytest.mark.parametrize(("n", "w", "classes"), [(40, 4, 4), (37, 5, 10), (12, 6, 2)])
def test_label_sorted_shards_have_non_decreasing_labels(n, w, classes):
    labels = _labels(n, classes, seed=n)
    shards = worker_shards(n, w, labels=labels, split="label_sorted")
    in_order = [int(labels[i]) for s in shards for i in s]
    assert in_order == sorted(in_order)
    # every worker's labels come entirely before the next worker's
    for a, b in itertools.pairwise(shards):
        assert max(int(labels[i]) for i in a) <= min(int(labels[i]) for i in b)
    # stable: equal labels keep the sample order
    flat = [i for s in shards for i in s]
    assert flat == sorted(range(n), key=lambda i: int(labels[i]))


def test_label_sorted_accepts_a_list_and_ignores_the_seed():
    labels = [3, 1, 2, 1, 0, 3, 2, 0]
    shards = worker_shards(len(labels), 4, labels=labels, split="label_sorted", seed=5)
    assert shards == worker_shards(len(labels), 4, labels=torch.tensor(labels), split="label_sorted", seed=6)
    assert [[labels[i] for i in s] for s in shards] == [[0, 0], [1, 1], [2, 2], [3, 3]]


def test_a_bad_split_raises():
    with pytest.raises(ValueError, match=r"split='random' is invalid"):
        worker_shards(10, 2, split="random")


@pytest.mark.parametrize(("n", "w"), [(3, 4), (0, 1), (10, 0), (10, -1)])
def test_too_few_samples_or_workers_raise(n, w):
    with pytest.raises(ValueError, match=rf"{n} samples cannot be split into num_workers={w}"):
        worker_shards(n, w)


@pytest.mark.parametrize("labels", [None, torch.zeros(9, dtype=torch.long), torch.zeros(11, dtype=torch.long)])
def test_label_sorted_needs_one_label_per_sample(labels):
    with pytest.raises(ValueError, match=r"split='label_sorted' needs one label per sample \(10\)"):
        worker_shards(10, 2, labels=labels, split="label_sorted")


# --- WorkerBatchSampler ---------------------------------------------------------------------------------------------


def _chunks(batch: list[int], b: int) -> list[list[int]]:
    return [batch[j : j + b] for j in range(0, len(batch), b)]


@pytest.mark.parametrize("shuffle", [True, False])
def test_batches_are_per_worker_chunks_in_worker_order(shuffle):
    n, w, b = 50, 4, 3
    shards = worker_shards(n, w, seed=1)
    workers = [2, 0, 3]  # any order: the batch is cut in this one
    sampler = WorkerBatchSampler(shards, workers, b, shuffle=shuffle, seed=4)
    batches = list(sampler)
    assert len(batches) == len(sampler)
    seen = {worker: [] for worker in workers}
    for batch in batches:
        assert len(batch) == b * len(workers)
        for worker, chunk in zip(workers, _chunks(batch, b)):
            assert set(chunk) <= set(shards[worker])
            seen[worker].extend(chunk)
    for worker in workers:
        # within an epoch a worker never sees a sample twice
        assert len(seen[worker]) == len(set(seen[worker])) == len(batches) * b
        if not shuffle:
            assert seen[worker] == shards[worker][: len(batches) * b]


def test_shuffle_false_yields_shard_order():
    shards = [[10, 11, 12, 13, 14], [20, 21, 22, 23], [30, 31, 32, 33, 34]]
    b = 2
    sampler = WorkerBatchSampler(shards, [0, 1, 2], b, shuffle=False)
    expected = [[x for s in shards for x in s[step * b : (step + 1) * b]] for step in range(min(map(len, shards)) // b)]
    assert list(sampler) == expected
    sampler.set_epoch(3)
    assert list(sampler) == expected  # no shuffle, no epoch dependence


@pytest.mark.parametrize(("n", "w", "b"), [(50, 4, 3), (23, 5, 2), (16, 8, 2), (40, 2, 7)])
def test_len_is_the_smallest_shard_over_batch_per_worker_on_every_rank(n, w, b):
    shards = worker_shards(n, w)
    expected = min(len(s) for s in shards) // b
    per_rank = [WorkerBatchSampler(shards, [r], b) for r in range(w)]
    assert [len(s) for s in per_rank] == [expected] * w
    assert [len(list(s)) for s in per_rank] == [expected] * w
    assert len(WorkerBatchSampler(shards, range(w), b)) == expected


def test_a_worker_sees_the_same_samples_in_any_layout():
    n, w, b = 80, 8, 3
    shards = worker_shards(n, w, seed=2)
    one_rank = WorkerBatchSampler(shards, range(0, 8), b, seed=11)
    two_ranks = [WorkerBatchSampler(shards, range(r * 4, (r + 1) * 4), b, seed=11) for r in range(2)]
    for epoch in (0, 1, 5):
        one_rank.set_epoch(epoch)
        for s in two_ranks:
            s.set_epoch(epoch)
        whole = list(one_rank)
        parts = [list(s) for s in two_ranks]
        assert len(whole) == len(parts[0]) == len(parts[1])
        for step, batch in enumerate(whole):
            chunks = _chunks(batch, b)
            for r in range(2):
                assert _chunks(parts[r][step], b) == chunks[r * 4 : (r + 1) * 4]
        # concatenating the ranks' batches is the 1-rank batch
        assert [p0 + p1 for p0, p1 in zip(*parts)] == whole


def test_set_epoch_reshuffles_reproducibly():
    shards = worker_shards(60, 3)
    sampler = WorkerBatchSampler(shards, [0, 1, 2], 4, seed=3)
    epoch0 = list(sampler)
    assert list(sampler) == epoch0  # no set_epoch, same order
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert epoch1 != epoch0
    # same samples per worker over a full pass when the shards divide evenly (20 = 5 * 4)
    for j in range(3):
        assert sorted(x for batch in epoch0 for x in _chunks(batch, 4)[j]) == sorted(shards[j])
        assert sorted(x for batch in epoch1 for x in _chunks(batch, 4)[j]) == sorted(shards[j])
    sampler.set_epoch(0)
    assert list(sampler) == epoch0
    twin = WorkerBatchSampler(shards, [0, 1, 2], 4, seed=3)
    twin.set_epoch(1)
    assert list(twin) == epoch1
    other_seed = WorkerBatchSampler(shards, [0, 1, 2], 4, seed=4)
    assert list(other_seed) != epoch0


def test_the_sampler_attribute_is_the_sampler_itself():
    sampler = WorkerBatchSampler(worker_shards(20, 2), [0, 1], 2)
    assert sampler.sampler is sampler
    sampler.sampler.set_epoch(4)
    assert sampler.epoch == 4


def test_it_feeds_a_dataloader_as_batch_sampler():
    n, w, b = 24, 4, 2
    data = torch.arange(n) * 10
    shards = worker_shards(n, w)
    sampler = WorkerBatchSampler(shards, [1, 3], b, seed=1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_sampler=sampler)
    got = [batch[0].tolist() for batch in loader]
    assert got == [[int(data[i]) for i in batch] for batch in sampler]
    assert len(loader) == len(sampler)


@pytest.mark.parametrize("b", [0, -2])
def test_batch_per_worker_below_1_raises(b):
    with pytest.raises(ValueError, match=rf"batch_per_worker={b} is invalid"):
        WorkerBatchSampler([[0, 1], [2, 3]], [0], b)


@pytest.mark.parametrize("workers", [[2], [-1], [0, 5], []])
def test_out_of_range_workers_raise(workers):
    with pytest.raises(ValueError, match=r"workers=.* is invalid: expected indices in \[0, 2\)"):
        WorkerBatchSampler([[0, 1], [2, 3]], workers, 1)


def test_a_shard_smaller_than_batch_per_worker_raises():
    shards = [[0, 1, 2, 3], [4, 5], [6, 7, 8]]
    with pytest.raises(ValueError, match=r"smallest shard has 2 samples: fewer than batch_per_worker=3"):
        WorkerBatchSampler(shards, [0], 3)  # the small shard is not even this rank's: the step count is global
    assert len(WorkerBatchSampler(shards, [0], 2)) == 1
