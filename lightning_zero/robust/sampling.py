"""Data for evaluating robust aggregation: fixed per-worker shards (IID or label-sorted) and the batches that feed them.

Lightning's usual ``DistributedSampler`` deals samples to *ranks*; a robustness evaluation needs to say which data
each *worker* sees (an honest worker holding only two classes is what makes label-sorted splits hard). Here global
worker ``i`` owns shard ``i`` for the whole run, whatever the process layout: ``world_size=2, workers_per_rank=4``
and ``world_size=1, workers_per_rank=8`` feed worker ``i`` the same samples.

Runbook (in a ``LightningDataModule.train_dataloader``; the Trainer needs ``use_distributed_sampler=False``)::

    k = getattr(trainer.strategy, "workers_per_rank", 1)
    shards = worker_shards(len(labels), k * trainer.world_size, labels=labels, split="label_sorted")
    sampler = WorkerBatchSampler(shards, range(trainer.global_rank * k, (trainer.global_rank + 1) * k), 16)
    DataLoader(dataset, batch_sampler=sampler)

A rank's batch is its workers' batches concatenated in worker order, which is how
:func:`lightning_zero.robust.workers.split_batch` cuts it again.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor
from torch.utils.data import Sampler

SPLITS = ("iid", "label_sorted")


def worker_shards(
    num_samples: int, num_workers: int, *, labels: Tensor | None = None, split: str = "iid", seed: int = 0
) -> list[list[int]]:
    """Partition ``range(num_samples)`` into ``num_workers`` contiguous shards (sizes differ by at most one).

    ``"iid"`` deals a seeded random permutation; ``"label_sorted"`` sorts by ``labels`` first (stable), so each
    worker holds one or two classes when there are about as many classes as workers.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is invalid: expected one of {SPLITS}")
    if num_workers < 1 or num_samples < num_workers:
        raise ValueError(f"{num_samples} samples cannot be split into num_workers={num_workers} non-empty shards")
    if split == "iid":
        order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed))
    else:
        if labels is None or len(labels) != num_samples:
            raise ValueError(f"split='label_sorted' needs one label per sample ({num_samples})")
        order = torch.sort(torch.as_tensor(labels), stable=True).indices
    return [chunk.tolist() for chunk in torch.tensor_split(order, num_workers)]


class WorkerBatchSampler(Sampler[list[int]]):
    """Yields one rank's batches: ``batch_per_worker`` samples of each of its workers' shards, concatenated.

    Each epoch every shard is reshuffled (seeded by ``seed`` and the epoch, identically on every rank) and cut into
    ``len = min shard size // batch_per_worker`` batches, the same number on every rank (ranks must agree on how
    many steps an epoch has); a shard's leftover samples wait for a later epoch's shuffle.

    Args:
        shards: every worker's sample indices (all ``n`` of them, so the step count is global).
        workers: the global indices of this rank's workers, in the order the batch is cut.
        batch_per_worker: samples per worker and micro-batch.
        shuffle: reshuffle each shard every epoch (``False``: shard order, for tests).
        seed: base seed of the shuffles.
    """

    def __init__(
        self,
        shards: Sequence[Sequence[int]],
        workers: Sequence[int],
        batch_per_worker: int,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if batch_per_worker < 1:
            raise ValueError(f"batch_per_worker={batch_per_worker} is invalid: expected an integer >= 1")
        bad = [w for w in workers if not 0 <= w < len(shards)]
        if bad or not workers:
            raise ValueError(f"workers={list(workers)} is invalid: expected indices in [0, {len(shards)})")
        self.shards = [list(s) for s in shards]
        self.workers = list(workers)
        self.batch_per_worker = batch_per_worker
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        if len(self) == 0:
            smallest = min(len(s) for s in self.shards)
            raise ValueError(
                f"the smallest shard has {smallest} samples: fewer than batch_per_worker={batch_per_worker}"
            )

    def set_epoch(self, epoch: int) -> None:
        """Called at every epoch start, through :attr:`sampler`."""
        self.epoch = epoch

    @property
    def sampler(self) -> WorkerBatchSampler:
        """This sampler itself. Lightning (``lightning.fabric.utilities.data._set_sampler_epoch``) calls ``set_epoch``
        on ``loader.sampler`` and ``loader.batch_sampler.sampler``, never on the batch sampler: without this every
        epoch would replay epoch 0's shuffle."""
        return self

    def __len__(self) -> int:
        return min(len(s) for s in self.shards) // self.batch_per_worker

    def _order(self, worker: int) -> list[int]:
        shard = self.shards[worker]
        if not self.shuffle:
            return shard
        g = torch.Generator().manual_seed(self.seed + 1_000_003 * self.epoch + worker)
        return [shard[i] for i in torch.randperm(len(shard), generator=g).tolist()]

    def __iter__(self) -> Iterator[list[int]]:
        orders = [self._order(w) for w in self.workers]
        b = self.batch_per_worker
        for step in range(len(self)):
            yield [i for order in orders for i in order[step * b : (step + 1) * b]]
