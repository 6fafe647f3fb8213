"""What ``lightning-zero-parity`` (:mod:`lightning_zero.tools.parity`) runs: its settings and exit codes, the job (the
user's module and data, the strategy, the steps), and the reference's global batches (:class:`GlobalBatchSampler`),
which the equivalence tests use too.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
from lightning_utilities.core.overrides import is_overridden
from torch.utils.data import DistributedSampler, Sampler

PROG = "lightning-zero-parity"
EXIT_PASS, EXIT_FAIL, EXIT_ERROR = 0, 1, 2
METRIC_PREFIX = "train"
REFERENCE = "reference"
TABLE_ROWS = 40
"""At most this many rows are printed (the largest differences, in model order); ``--json`` holds every row."""
LOG_TAIL_LINES = 30
SET_BY_THE_CHECK = frozenset(
    {
        "accelerator", "devices", "num_nodes", "strategy", "plugins", "callbacks", "logger", "max_steps",
        "max_epochs", "min_steps", "min_epochs", "max_time", "limit_train_batches", "limit_val_batches",
        "overfit_batches", "use_distributed_sampler", "num_sanity_val_steps", "enable_checkpointing",
        "enable_progress_bar", "enable_model_summary", "default_root_dir",
    }
)  # fmt: skip
"""``Trainer`` arguments that ``--trainer-kwargs`` may not set: the check chooses them for both runs."""
DIST_VARS = (
    "RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)  # fmt: skip
"""Cleared in every process the check starts: a leaked ``LOCAL_RANK`` makes Lightning believe it was launched."""
PRELOAD = ["torch", "torch.distributed", "lightning", "lightning.pytorch", "lightning_zero"]
"""What the forkserver imports once, so each process it forks starts in a fraction of a second. Not this module: under
``python -m`` each process runs it afresh as its ``__main__``, and runpy warns when it is already imported."""


class ParityError(Exception):
    """The check cannot be made (exit code 2); the message says which input or process and why."""


# ---------------------------------------------------------------- the reference's batches
class GlobalBatchSampler(Sampler[list[int]]):
    """The global batches of ``world_size`` data-parallel ranks, for one process: batch k is every rank's k-th batch
    under Lightning's shuffling ``DistributedSampler(num_replicas=world_size, rank=r, shuffle=True, seed=seed)``,
    concatenated in rank order.

    Each rank's sampler pads its share to ``ceil(dataset_size / world_size)`` indices by repeating indices, and its
    ``DataLoader`` batches them by ``batch_size`` (dropping a short last batch if ``drop_last``), as Lightning does.

    It exposes itself as ``.sampler`` because Lightning calls ``set_epoch`` on ``batch_sampler.sampler``.

    Args:
        dataset_size: Number of samples in the dataset.
        world_size: Number of data-parallel ranks replayed.
        batch_size: Samples per rank and batch; a global batch holds up to ``world_size * batch_size``.
        seed: The ``DistributedSampler``'s seed (Lightning's: ``seed_everything``'s seed, or 0).
        drop_last: Whether each rank's loader drops its short last batch.
    """

    def __init__(
        self, dataset_size: int, world_size: int, batch_size: int, seed: int = 0, drop_last: bool = False
    ) -> None:
        if world_size < 1 or batch_size < 1:
            raise ValueError(f"world_size and batch_size must be at least 1, got {world_size} and {batch_size}")
        self.dataset_size, self.world_size, self.batch_size = dataset_size, world_size, batch_size
        self.seed, self.drop_last = seed, drop_last
        self.epoch = 0
        self.sampler = self

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _per_rank(self) -> list[list[int]]:
        out = []
        for rank in range(self.world_size):
            sampler = DistributedSampler(
                range(self.dataset_size), num_replicas=self.world_size, rank=rank, shuffle=True, seed=self.seed
            )
            sampler.set_epoch(self.epoch)
            out.append(list(sampler))
        return out

    def __iter__(self) -> Iterator[list[int]]:
        per_rank = self._per_rank()
        for k in range(len(self)):
            window = slice(k * self.batch_size, (k + 1) * self.batch_size)
            yield [index for indices in per_rank for index in indices[window]]

    def __len__(self) -> int:
        per_rank = math.ceil(self.dataset_size / self.world_size)
        return per_rank // self.batch_size if self.drop_last else math.ceil(per_rank / self.batch_size)


# ---------------------------------------------------------------- what to run
@dataclass(frozen=True)
class Job:
    """Everything a process of the check needs (it is pickled to each one)."""

    module: str
    datamodule: str | None
    init_kwargs: dict[str, Any]
    strategy: str
    devices: int
    steps: int
    batch_size: int | None
    seed: int
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)


def load_class(spec: str, base: type, what: str) -> type:
    """The class named by ``spec`` (``package.module:Class`` or ``path/to/file.py:Class``), a subclass of ``base``.

    A file is imported under its stem with its folder on ``sys.path``, as ``python path/to/file.py`` would see its
    sibling modules.

    Raises:
        ParityError: ``spec`` is malformed, or its module or class cannot be imported, or the class is not a ``base``.
    """
    source, sep, name = spec.rpartition(":")
    if not sep or not source or not name:
        raise ParityError(
            f"{what} {spec!r}: expected MODULE:CLASS, e.g. my_project.model:LitModel or path/to/model.py:LitModel"
        )
    try:
        if source.endswith(".py"):
            module = _import_file(Path(source))
        else:
            if os.getcwd() not in sys.path:  # console scripts leave the working directory off the path
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(source)
    except ParityError:
        raise
    except Exception as err:  # the user's import can fail in any way: name what failed
        raise ParityError(f"{what} {spec!r}: cannot import {source!r} ({type(err).__name__}: {err})") from None
    obj: Any = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ParityError(f"{what} {spec!r}: {source!r} has no attribute {name!r}")
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise ParityError(f"{what} {spec!r}: {obj!r} is not a {base.__name__} subclass")
    return obj


def _import_file(path: Path) -> Any:
    if not path.is_file():
        raise ParityError(f"no such file: {str(path)!r}")
    path = path.resolve()
    loaded = sys.modules.get(path.stem)
    if loaded is not None:
        if Path(getattr(loaded, "__file__", "") or "").resolve() == path:
            return loaded
        raise ParityError(
            f"{str(path)!r} would be imported as {path.stem!r}, which is already the module {loaded!r}:"
            " rename the file or name it by its dotted module path"
        )
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # before executing it: dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[path.stem]
        raise
    return module


def trains_from(module_cls: type, datamodule_cls: type | None) -> None:
    """Raise unless the datamodule, or else the module, defines ``train_dataloader()``."""
    if datamodule_cls is not None:
        if not is_overridden("train_dataloader", datamodule_cls, L.LightningDataModule):
            raise ParityError(f"--datamodule {datamodule_cls.__qualname__} defines no train_dataloader()")
    elif not is_overridden("train_dataloader", module_cls, L.LightningModule):
        raise ParityError(
            f"{module_cls.__qualname__} defines no train_dataloader() and no --datamodule was given:"
            " the check needs the training data (define train_dataloader() or pass --datamodule MODULE:CLASS)"
        )
