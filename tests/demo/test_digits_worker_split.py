"""DigitsDataModule(worker_split=...): per-worker shards of the training set, cut the way robust_ddp_scratch cuts a
rank's batch (chunk j of rank r = worker r * workers_per_rank + j), checked with a stand-in Trainer per rank."""

from __future__ import annotations

import math
from itertools import pairwise
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from torch.utils.data import RandomSampler

from lightning_zero.demo import DigitsDataModule, DigitsMLPModule

WORLD, K, BATCH = 2, 4, 32  # n = 8 workers, 8 samples per worker and batch


def _stand_in(rank: int, world_size: int = WORLD, k: int = K, use_distributed_sampler: bool = False) -> SimpleNamespace:
    """What train_dataloader reads from ``self.trainer`` (a plain attribute of LightningDataModule)."""
    return SimpleNamespace(
        strategy=SimpleNamespace(workers_per_rank=k),
        world_size=world_size,
        global_rank=rank,
        _accelerator_connector=SimpleNamespace(use_distributed_sampler=use_distributed_sampler, is_distributed=True),
    )


def _loaders(split: str, k: int = K) -> tuple[DigitsDataModule, list[torch.utils.data.DataLoader]]:
    """One data module per rank (as in a real run), each with its rank's training loader."""
    modules, loaders = [], []
    for rank in range(WORLD):
        dm = DigitsDataModule(batch_size=BATCH, worker_split=split)
        dm.setup("fit")
        dm.trainer = _stand_in(rank, k=k)
        modules.append(dm)
        loaders.append(dm.train_dataloader())
    return modules[0], loaders


def _epoch_indices(loader: torch.utils.data.DataLoader) -> list[list[int]]:
    return [list(batch) for batch in loader.batch_sampler]


@pytest.mark.parametrize(("k", "most_classes"), [(4, 3), (8, 2)])
def test_label_sorted_workers_hold_few_classes_in_worker_order(k: int, most_classes: int) -> None:
    """A label-sorted shard spans at most ``1 + ceil(shard size / smallest class)`` classes: with n = 8 workers the
    ~157-sample shards outgrow the smallest train class (116 samples), so 3 classes; with n = 16 (~79) only 2."""
    dm, loaders = _loaders("label_sorted", k=k)
    counts = torch.bincount(dm.train_set.tensors[1])
    biggest_shard = max(len(s) for s in loaders[0].batch_sampler.shards)
    assert 1 + math.ceil(biggest_shard / int(counts.min())) == most_classes
    assert all(len(loader) == len(loaders[0]) > 1 for loader in loaders)  # ranks agree on the steps per epoch
    per_worker = BATCH // k
    for batches in zip(*loaders):  # one step: every rank's batch
        chunks = []
        for x, y in batches:
            assert x.shape == (BATCH, 64) and y.shape == (BATCH,)
            chunks += list(y.split(per_worker))  # worker order: rank 0's workers 0..3, then rank 1's 4..7
        assert len(chunks) == WORLD * k
        for chunk in chunks:
            assert len(set(chunk.tolist())) <= most_classes
        for a, b in pairwise(chunks):
            assert a.max() <= b.min()  # shards are sorted by label: worker i's classes come before worker i+1's
    # The loader yields exactly the samples its batch sampler names.
    labels = dm.train_set.tensors[1]
    first = next(iter(loaders[1]))[1]
    assert torch.equal(first, labels[next(iter(loaders[1].batch_sampler))])


def test_iid_ranks_cover_disjoint_samples() -> None:
    dm, loaders = _loaders("iid")
    first = [i for loader in loaders for i in _epoch_indices(loader)[0]]
    assert len(first) == WORLD * BATCH and len(set(first)) == len(first)  # no sample twice in one global step
    epoch = [{i for batch in _epoch_indices(loader) for i in batch} for loader in loaders]
    assert not epoch[0] & epoch[1]  # every worker owns its shard for the whole run
    assert sum(len(e) for e in epoch) == sum(len(b) for loader in loaders for b in _epoch_indices(loader))
    assert all(0 <= i < len(dm.train_set) for e in epoch for i in e)
    # iid shards mix the classes: the first global batch holds most of them.
    labels = dm.train_set.tensors[1]
    assert len(set(labels[first].tolist())) >= 8


def test_lightning_reaches_the_batch_samplers_set_epoch() -> None:
    _, loaders = _loaders("iid")
    before = _epoch_indices(loaders[0])
    _set_sampler_epoch(loaders[0], 1)  # what Lightning's fit loop calls at every epoch start
    assert loaders[0].batch_sampler.epoch == 1
    assert _epoch_indices(loaders[0]) != before  # a new shuffle of the same shards
    assert {i for b in _epoch_indices(loaders[0]) for i in b} <= {
        i for s in loaders[0].batch_sampler.shards[:K] for i in s
    }


def test_fit_reshuffles_every_epoch() -> None:
    """Two epochs of a real (tiny) fit: Lightning keeps our batch sampler and moves it to epoch 1."""
    dm = DigitsDataModule(batch_size=16, worker_split="label_sorted")
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, use_distributed_sampler=False, max_epochs=2, limit_train_batches=2,
        limit_val_batches=0, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(DigitsMLPModule(hidden_sizes=(8,)), datamodule=dm)
    assert trainer.train_dataloader.batch_sampler.epoch == 1


def test_real_trainer_single_process_is_one_worker() -> None:
    dm = DigitsDataModule(batch_size=BATCH, worker_split="label_sorted")
    dm.setup("fit")
    dm.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, use_distributed_sampler=False)
    loader = dm.train_dataloader()
    assert loader.batch_sampler.workers == [0] and len(loader.batch_sampler.shards) == 1
    x, y = next(iter(loader))
    assert x.shape == (BATCH, 64) and y.shape == (BATCH,)


def test_batch_size_not_divisible_by_workers_per_rank() -> None:
    dm = DigitsDataModule(batch_size=30, worker_split="iid")
    dm.setup("fit")
    dm.trainer = _stand_in(0)
    with pytest.raises(ValueError, match=r"batch_size=30 .*not divisible by workers_per_rank=4"):
        dm.train_dataloader()


def test_distributed_sampler_must_be_off() -> None:
    dm = DigitsDataModule(worker_split="iid")
    dm.setup("fit")
    dm.trainer = _stand_in(0, use_distributed_sampler=True)
    with pytest.raises(ValueError, match=r"set trainer\.use_distributed_sampler=false"):
        dm.train_dataloader()


def test_bad_split() -> None:
    with pytest.raises(ValueError, match=r"worker_split='dirichlet' is invalid: expected None or one of \('iid', "):
        DigitsDataModule(worker_split="dirichlet")


def test_no_worker_split_keeps_the_shuffled_loader() -> None:
    dm = DigitsDataModule(batch_size=BATCH)
    dm.setup("fit")
    dm.trainer = _stand_in(1)  # ignored without a worker split
    loader = dm.train_dataloader()
    assert loader.batch_size == BATCH and isinstance(loader.sampler, RandomSampler)
    val = dm.val_dataloader()
    assert val.batch_size == BATCH and not isinstance(val.sampler, RandomSampler)
