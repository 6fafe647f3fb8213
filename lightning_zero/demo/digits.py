"""A second demo task: scikit-learn's 8x8 handwritten digits and a small MLP classifier (``data=digits``,
``model=digits_mlp``, ``experiment=digits_mlp``).

The images ship inside scikit-learn (1,797 of them, 10 classes, no download), which is imported only when the data
is loaded, so the core package works without it; it comes with ``pip install "lightning-zero[examples]"``.

For robust aggregation (``strategy=robust_ddp_scratch``), ``data.worker_split=iid|label_sorted`` gives each virtual
worker a fixed shard of the training set (:mod:`lightning_zero.robust.sampling`); the Trainer then needs
``use_distributed_sampler=false`` (the ``trainer`` configs lack the key, hence the ``+``)::

    lightning-zero-train experiment=digits_mlp trainer=ddp_sim strategy=robust_ddp_scratch \
        strategy.workers_per_rank=4 data.worker_split=label_sorted +trainer.use_distributed_sampler=false
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from lightning_zero.demo.model import shard_fsdp2
from lightning_zero.robust.sampling import SPLITS, WorkerBatchSampler, worker_shards

EXTRA_HINT = 'pip install "lightning-zero[examples]"'
NUM_FEATURES, NUM_CLASSES = 64, 10


def load_digits_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits as ``(images, labels)``: float32 ``(N, 64)`` pixels scaled to [0, 1], int64 ``(N,)``."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ImportError(f"the digits demo needs scikit-learn: {EXTRA_HINT}") from err
    images, labels = load_digits(return_X_y=True)
    return torch.as_tensor(images, dtype=torch.float32) / 16.0, torch.as_tensor(labels, dtype=torch.long)


class DigitsDataModule(L.LightningDataModule):
    """scikit-learn's 8x8 digits, split once into train/val/test by ``split_seed`` (the same split on every rank).

    Args:
        batch_size: samples per batch and process.
        val_fraction, test_fraction: shares of the 1,797 images held out; the rest is for training.
        split_seed: seed of the permutation that makes the split (independent of the global seed); with a
            ``worker_split`` also the seed of the IID shards and of their per-epoch shuffles.
        num_workers: data-loader worker processes.
        worker_split: ``None``: the training loader shuffles and Lightning deals its batches to ranks (its
            ``DistributedSampler``). ``"iid"`` or ``"label_sorted"``: each of the ``n = workers_per_rank x
            world_size`` virtual workers owns a fixed shard of the training set
            (:func:`~lightning_zero.robust.sampling.worker_shards`), and a rank's batch is its workers'
            ``batch_size // workers_per_rank`` samples each, concatenated in worker order
            (:class:`~lightning_zero.robust.sampling.WorkerBatchSampler`): the cut ``robust_ddp_scratch`` makes.
            ``workers_per_rank`` is read from ``trainer.strategy`` (1 for strategies without it) and must divide
            ``batch_size``; the Trainer needs ``use_distributed_sampler=False``. Validation and test loaders are
            the same either way.
    """

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        split_seed: int = 0,
        num_workers: int = 0,
        worker_split: str | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} is invalid: expected an integer >= 1")
        if worker_split is not None and worker_split not in SPLITS:
            raise ValueError(f"worker_split={worker_split!r} is invalid: expected None or one of {SPLITS}")
        if not (0 < val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
            raise ValueError(
                f"val_fraction={val_fraction}, test_fraction={test_fraction} are invalid: expected val_fraction in"
                " (0, 1), test_fraction in [0, 1) and a sum below 1"
            )
        try:  # fail when the config is instantiated, not later in setup()
            import sklearn  # noqa: F401
        except ImportError as err:
            raise ImportError(f"DigitsDataModule needs scikit-learn: {EXTRA_HINT}") from err
        self.save_hyperparameters()
        self.batch_size, self.num_workers = batch_size, num_workers
        self.val_fraction, self.test_fraction, self.split_seed = val_fraction, test_fraction, split_seed
        self.worker_split = worker_split
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None
        self.test_set: TensorDataset | None = None

    def model_kwargs(self) -> dict[str, Any]:
        """The arguments a model needs from this data: ``in_features`` and ``num_classes``."""
        return {"in_features": NUM_FEATURES, "num_classes": NUM_CLASSES}

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        images, labels = load_digits_arrays()
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.split_seed))
        n_val, n_test = round(len(labels) * self.val_fraction), round(len(labels) * self.test_fraction)
        val, test, train = order[:n_val], order[n_val : n_val + n_test], order[n_val + n_test :]
        self.train_set = TensorDataset(images[train], labels[train])
        self.val_set = TensorDataset(images[val], labels[val])
        self.test_set = TensorDataset(images[test], labels[test])

    def _loader(self, dataset: TensorDataset | None, shuffle: bool) -> DataLoader:
        assert dataset is not None, "call setup() first"
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.num_workers)

    def _worker_layout(self) -> tuple[int, int, int]:
        """``(workers_per_rank, world_size, global_rank)`` of the attached Trainer; ``(1, 1, 0)`` without one."""
        trainer = self.trainer
        if trainer is None:  # e.g. inspecting the data in a notebook: one process, one worker
            return 1, 1, 0
        k = getattr(trainer.strategy, "workers_per_rank", 1)
        world_size, rank = trainer.world_size, trainer.global_rank
        connector = getattr(trainer, "_accelerator_connector", None)
        # Otherwise Lightning tries to rebuild the batch sampler around a DistributedSampler (it cannot: a
        # WorkerBatchSampler takes shards, not a sampler), for every strategy it deems distributed, ours at 1 rank too.
        if getattr(connector, "use_distributed_sampler", False) and (
            world_size > 1 or getattr(connector, "is_distributed", False)
        ):
            raise ValueError(
                f"worker_split={self.worker_split!r} deals the training data to workers itself, but the Trainer has"
                f" use_distributed_sampler=True (world_size={world_size}): set trainer.use_distributed_sampler=false"
                " (on the command line +trainer.use_distributed_sampler=false where the trainer config lacks the key)"
            )
        return k, world_size, rank

    def train_dataloader(self) -> DataLoader:
        if self.worker_split is None:
            return self._loader(self.train_set, shuffle=True)
        assert self.train_set is not None, "call setup() first"
        k, world_size, rank = self._worker_layout()
        if self.batch_size % k:
            raise ValueError(
                f"batch_size={self.batch_size} (per process) is not divisible by workers_per_rank={k}: expected a"
                f" multiple of {k}, so that every worker gets the same number of samples"
            )
        labels = self.train_set.tensors[1]
        shards = worker_shards(
            len(labels), k * world_size, labels=labels, split=self.worker_split, seed=self.split_seed
        )
        batch_sampler = WorkerBatchSampler(
            shards, range(rank * k, (rank + 1) * k), self.batch_size // k, shuffle=True, seed=self.split_seed
        )
        return DataLoader(self.train_set, batch_sampler=batch_sampler, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)


class DigitsMLPModule(L.LightningModule):
    """An MLP classifier; logs ``train/loss``, ``val/loss``, ``val/acc`` (torchmetrics ``MulticlassAccuracy``) and,
    in ``trainer.test``, ``test/loss`` and ``test/acc``.

    Args:
        in_features, num_classes: from the data module's ``model_kwargs()``.
        hidden_sizes: widths of the hidden layers (ReLU, dropout after each).
        dropout: dropout probability after each hidden layer.
        optimizer: a partial optimizer (``params -> Optimizer``), e.g. Hydra's ``_partial_: true``; default AdamW.

    The network is built in ``configure_model()`` (under ``strategy=fsdp2`` it is then sharded with FSDP2's
    ``fully_shard``). ``val_history`` holds ``(global_step, val/loss)`` for every validation pass, the sanity check
    included: the history of this module's optimized metric (``history_metric``).
    """

    history_metric = "val/loss"

    def __init__(
        self,
        in_features: int = NUM_FEATURES,
        num_classes: int = NUM_CLASSES,
        hidden_sizes: Sequence[int] = (128, 64),
        dropout: float = 0.1,
        optimizer: Callable[..., torch.optim.Optimizer] | None = None,
    ) -> None:
        super().__init__()
        if in_features < 1 or num_classes < 2 or any(int(h) < 1 for h in hidden_sizes):
            raise ValueError(
                f"in_features={in_features}, num_classes={num_classes}, hidden_sizes={list(hidden_sizes)}: expected"
                " in_features >= 1, num_classes >= 2 and hidden sizes >= 1"
            )
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout={dropout} is invalid: expected a number in [0, 1)")
        hidden = [int(h) for h in hidden_sizes]  # a plain list, also when Hydra passes a ListConfig
        self.save_hyperparameters(
            {"in_features": in_features, "num_classes": num_classes, "hidden_sizes": hidden, "dropout": dropout}
        )
        self.optimizer_factory = optimizer
        self.net: nn.Sequential | None = None
        self.val_loss, self.val_acc = MeanMetric(), MulticlassAccuracy(num_classes=num_classes)
        self.test_loss, self.test_acc = MeanMetric(), MulticlassAccuracy(num_classes=num_classes)
        self.val_history: list[tuple[int, float]] = []

    def configure_model(self) -> None:
        """Build the network (first call only); under ``ModelParallelStrategy`` shard it with FSDP2."""
        if self.net is None:
            h = self.hparams
            layers: list[nn.Module] = []
            width = h.in_features
            for size in h.hidden_sizes:
                layers += [nn.Linear(width, size), nn.ReLU(), nn.Dropout(h.dropout)]
                width = size
            self.net = nn.Sequential(*layers, nn.Linear(width, h.num_classes))
        shard_fsdp2(self.net, [], self.device_mesh)  # one unit; device_mesh: only under ModelParallelStrategy

    @property
    def pipeline_layers(self) -> nn.Sequential | None:
        """What ``pipeline_scratch`` cuts into stages: the whole network."""
        return self.net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.net is not None, "configure_model() builds the network"
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def _update(self, batch: tuple[torch.Tensor, torch.Tensor], loss: MeanMetric, acc: MulticlassAccuracy) -> None:
        x, y = batch
        logits = self(x)
        loss.update(F.cross_entropy(logits, y), weight=len(y))
        acc.update(logits, y)

    def _log_epoch(self, stage: str, loss: MeanMetric, acc: MulticlassAccuracy, prog_bar: bool) -> float:
        """Log ``<stage>/loss`` and ``<stage>/acc`` over the epoch, reset the metrics; returns the loss."""
        loss_value, acc_value = loss.compute(), acc.compute()  # collectives: every rank calls them
        loss.reset()
        acc.reset()
        self.log(f"{stage}/loss", loss_value, prog_bar=prog_bar, sync_dist=True)  # equal on every rank already
        self.log(f"{stage}/acc", acc_value, prog_bar=prog_bar, sync_dist=True)
        return float(loss_value)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._update(batch, self.val_loss, self.val_acc)

    def on_validation_epoch_end(self) -> None:
        loss = self._log_epoch("val", self.val_loss, self.val_acc, prog_bar=True)
        self.val_history.append((self.global_step, loss))

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._update(batch, self.test_loss, self.test_acc)

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test", self.test_loss, self.test_acc, prog_bar=False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
        factory = self.optimizer_factory or (lambda params: torch.optim.AdamW(params, lr=1e-3))
        return factory(groups)
