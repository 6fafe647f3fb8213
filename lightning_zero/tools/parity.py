"""``lightning-zero-parity`` (also ``python -m lightning_zero.tools.parity``): check that your LightningModule trains
the same under a data-parallel strategy as in one process, before you spend cluster time on it.

Runbook::

    lightning-zero-parity my_project.model:LitModel --strategy zero3_scratch --devices 2 --steps 5
    lightning-zero-parity path/to/model.py:LitModel --init-kwargs '{"hidden": 64}' --batch-size 4 --json parity.json
    lightning-zero-parity my_project.model:LitModel --datamodule my_project.data:LitData --strategy zero2_scratch
    lightning-zero-parity my_project.model:LitModel --trainer-kwargs '{"accumulate_grad_batches": 2}'
    lightning-zero-parity lightning.pytorch.demos.boring_classes:BoringModel --strategy ddp   # the tool itself

``MODULE:CLASS`` is an importable module path (the current directory is on the path) or a ``.py`` file; the module is
built as ``CLASS(**init_kwargs)`` after ``seed_everything(--seed)``, in every run. The training data come from its
``train_dataloader()``, or from the ``LightningDataModule`` given with ``--datamodule`` (built without arguments).

Two fits of ``--steps`` optimizer steps, from the same seed, on CPU with one thread per process:

- the strategy run: ``--devices`` processes that look like ``torchrun`` ranks to Lightning (gloo), each fed its share
  of every batch by Lightning's shuffling ``DistributedSampler`` (``--batch-size`` samples per rank, default the
  loader's batch size);
- the reference: ``Trainer(devices=1, strategy="auto")`` in one process, whose batch k is the concatenation, in rank
  order, of every rank's k-th batch (:class:`GlobalBatchSampler`), so it holds ``devices x batch size`` samples.

Averaging gradients over ranks of per-rank *mean* losses gives the gradient of the global batch's mean loss, so a
correct strategy ends where the reference does, up to float rounding (about 1e-7 after a few fp32 steps). The tool
compares rank 0's ``module.state_dict()`` after ``fit`` (parameters and buffers) with the reference's, and every
logged metric whose name starts with ``train`` after each optimizer step (the strategy run's value is the mean over
ranks: the global batch's value for a batch mean, logged with ``sync_dist=True`` or not), then prints a table of the
largest absolute difference per tensor and metric and a verdict. ``--json OUT`` writes the table and the verdict.

These differ legitimately between N processes and one, and make the check fail without a strategy bug: a loss that
is not a mean over the batch (a sum, a per-rank weighting, anything reading ``self.global_rank`` or
``self.trainer.world_size``); BatchNorm without ``SyncBatchNorm`` (each rank normalizes its own samples); dropout or
random augmentation (the ranks and the reference draw different random numbers: set ``p=0`` for the check); metrics
that are not batch means. The tool prints a note when the module has BatchNorm or dropout layers.
The training loader must be a plain ``torch.utils.data.DataLoader`` over a map-style dataset with the default sampler
(Lightning replaces it with a ``DistributedSampler``); ``train_dataloader()`` is called under ``--seed``, so data
drawn at random there are the same in every process.

``--trainer-kwargs`` JSON goes to both ``Trainer`` calls (``accumulate_grad_batches``, ``gradient_clip_val``,
``precision``, ...); the arguments the check sets itself are refused. The processes' output is kept out of the
terminal and the last lines of it are printed when a process fails; ``--timeout`` (default 600 s) bounds the runs,
all processes together, and kills them when it runs out (a collective that never completes hangs every rank).

Exit codes: 0 PASS, 1 FAIL, 2 the check could not be made (bad arguments or input, a process that crashed or timed
out).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import math
import multiprocessing.connection
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.multiprocessing as mp
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.seed import isolate_rng
from lightning_utilities.core.overrides import is_overridden
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler, SequentialSampler

from lightning_zero.tools.overrides import did_you_mean

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
_DIST_VARS = (
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


def _trains_from(module_cls: type, datamodule_cls: type | None) -> None:
    """Raise unless the datamodule, or else the module, defines ``train_dataloader()``."""
    if datamodule_cls is not None:
        if not is_overridden("train_dataloader", datamodule_cls, L.LightningDataModule):
            raise ParityError(f"--datamodule {datamodule_cls.__qualname__} defines no train_dataloader()")
    elif not is_overridden("train_dataloader", module_cls, L.LightningModule):
        raise ParityError(
            f"{module_cls.__qualname__} defines no train_dataloader() and no --datamodule was given:"
            " the check needs the training data (define train_dataloader() or pass --datamodule MODULE:CLASS)"
        )


# ---------------------------------------------------------------- inside each process
class _StepRecorder(L.Callback):
    """The ``train*`` entries of ``trainer.callback_metrics`` after each optimizer step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step > len(self.steps):  # not after micro-batches that only accumulated gradients
            metrics = trainer.callback_metrics.items()
            self.steps.append({k: float(v) for k, v in metrics if k.startswith(METRIC_PREFIX)})


def _check_loader(loader: Any) -> DataLoader:
    """The user's training loader, if the reference can replay it."""
    if type(loader) is not DataLoader:
        raise ParityError(
            f"train_dataloader() returned a {type(loader).__qualname__}: the check needs a torch.utils.data.DataLoader"
            " (not a subclass, a list or a CombinedLoader) to build the reference's global batches from"
        )
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise ParityError(
            f"the training dataset is a {type(dataset).__qualname__}, an iterable dataset or one without __len__:"
            " Lightning gives each rank a share of a map-style dataset only"
        )
    if loader.batch_size is None:
        raise ParityError(
            "the training DataLoader has a custom batch_sampler (or batch_size=None): the check replays only"
            " Lightning's DistributedSampler batched by batch_size"
        )
    if not isinstance(loader.sampler, (SequentialSampler, RandomSampler)):
        raise ParityError(
            f"the training DataLoader has a custom sampler ({type(loader.sampler).__qualname__}): Lightning wraps it in"
            " a DistributedSamplerWrapper, which the check does not replay"
        )
    return loader


def _replace_batches(loader: DataLoader, **batching: Any) -> DataLoader:
    """``loader`` with new batching arguments and everything else that decides the batches kept."""
    return DataLoader(
        loader.dataset,
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        worker_init_fn=loader.worker_init_fn,
        **batching,
    )


def _hook_loader(source: Any, job: Job, rank: int | None, seen: dict[str, Any]) -> None:
    """Make ``source.train_dataloader`` build its loader under ``job.seed`` and reshape it for this run: the strategy
    run keeps it (or takes ``--batch-size``), the reference gets the global batches. Records the batch size in
    ``seen``."""
    user_hook = source.train_dataloader

    # A plain function, not a callable object: Lightning's is_overridden reads the hook's __code__.
    def train_dataloader() -> DataLoader:
        # Data drawn at random when the loader is built (Lightning's RandomDataset) are then the same in every run,
        # and the training RNG stream continues as if the hook had not drawn.
        with isolate_rng():
            L.seed_everything(job.seed, verbose=False)
            loader = _check_loader(user_hook())
        batch_size = job.batch_size or loader.batch_size
        seen["batch_size"] = batch_size
        if rank is None:
            sampler = GlobalBatchSampler(len(loader.dataset), job.devices, batch_size, job.seed, loader.drop_last)
            return _replace_batches(loader, batch_sampler=sampler)
        if job.batch_size is not None:
            return _replace_batches(loader, batch_size=batch_size, drop_last=loader.drop_last)
        return loader

    source.train_dataloader = train_dataloader


def _notes(module: nn.Module, world_size: int) -> list[str]:
    """Layers in ``module`` that make N processes and one differ legitimately."""
    norms = [
        name
        for name, m in module.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)
    ]
    dropouts = [
        f"{name} (p={m.p:g})"
        for name, m in module.named_modules()
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
    ]
    notes = []
    if norms:
        notes.append(
            f"BatchNorm without SyncBatchNorm in {', '.join(norms)}: each of the {world_size} processes normalizes its"
            " own samples, the reference the global batch; this differs legitimately"
        )
    if dropouts:
        notes.append(
            f"dropout in {', '.join(dropouts)}: the processes and the reference draw different masks; set p=0 for"
            " the check"
        )
    return notes


def _fit(job: Job, rank: int | None) -> dict[str, Any]:
    """One fit: rank ``rank`` of the strategy run, or the reference when ``rank`` is None."""
    module_cls = load_class(job.module, L.LightningModule, "MODULE:CLASS")
    datamodule_cls = load_class(job.datamodule, L.LightningDataModule, "--datamodule") if job.datamodule else None
    L.seed_everything(job.seed, verbose=False)
    module = module_cls(**job.init_kwargs)
    datamodule = datamodule_cls() if datamodule_cls is not None else None
    seen: dict[str, Any] = {}
    _hook_loader(datamodule if datamodule is not None else module, job, rank, seen)
    recorder = _StepRecorder()
    reference = rank is None
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1 if reference else job.devices,
        strategy="auto" if reference else job.strategy,
        # Explicit, so that a SLURM, LSF or MPI job around the check cannot make Lightning read its ranks instead.
        plugins=[LightningEnvironment()],
        use_distributed_sampler=not reference,
        max_steps=job.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
        **job.trainer_kwargs,
    )
    trainer.fit(module, datamodule=datamodule)
    result: dict[str, Any] = {"global_step": trainer.global_step, "metrics": recorder.steps, **seen}
    if reference or rank == 0:  # our strategies, like Lightning's ddp, leave the whole module on every rank
        result["state"] = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    if reference:
        result["notes"] = _notes(module, job.devices)
    return result


def _key(rank: int | None) -> str:
    return REFERENCE if rank is None else f"rank{rank}"


def _label(rank: int | None) -> str:
    return "the reference" if rank is None else f"rank {rank}"


def _process(rank: int | None, job: Job, port: int, workdir: str) -> None:
    """The target of each process: fit, then write ``<key>.pt``, or ``<key>.error`` and exit with code 2."""
    log = os.open(os.path.join(workdir, f"{_key(rank)}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    for var in _DIST_VARS:
        os.environ.pop(var, None)
    if rank is not None:
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            GROUP_RANK="0",
            WORLD_SIZE=str(job.devices),
            LOCAL_WORLD_SIZE=str(job.devices),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    torch.set_num_threads(1)  # N processes share the machine's cores
    try:
        result = _fit(job, rank)
    except ParityError as err:
        Path(workdir, f"{_key(rank)}.error").write_text(str(err))
        sys.exit(EXIT_ERROR)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    torch.save(result, os.path.join(workdir, f"{_key(rank)}.pt"))


# ---------------------------------------------------------------- launching
def _tail(workdir: str, rank: int | None) -> str:
    path = Path(workdir, f"{_key(rank)}.log")
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    shown = lines[-LOG_TAIL_LINES:] or ["(no output)"]
    return "\n".join(f"    {line}" for line in shown)


def _failure(workdir: str, rank: int | None, exitcode: int) -> ParityError:
    error = Path(workdir, f"{_key(rank)}.error")
    if error.exists():
        return ParityError(error.read_text())
    how = f"was killed by signal {-exitcode}" if exitcode < 0 else f"failed with exit code {exitcode}"
    return ParityError(f"{_label(rank)} {how}; the last lines of its output:\n{_tail(workdir, rank)}")


def run(job: Job, workdir: str, timeout: float) -> dict[str, dict[str, Any]]:
    """Start the ``job.devices`` ranks and the reference together, wait for all of them, and return their results by
    key (``"rank0"``, ..., ``"reference"``).

    Raises:
        ParityError: a process refused its input, crashed, or they did not all finish within ``timeout`` seconds;
            the others are killed.
    """
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts, on this interpreter's first check
    else:
        ctx = mp.get_context("spawn")
    port = find_free_network_port()
    ranks: list[int | None] = [*range(job.devices), None]
    processes = {rank: ctx.Process(target=_process, args=(rank, job, port, workdir)) for rank in ranks}
    deadline = time.monotonic() + timeout
    try:
        for process in processes.values():
            process.start()
        pending = dict(processes)
        while pending:
            remaining = deadline - time.monotonic()
            ready = multiprocessing.connection.wait([p.sentinel for p in pending.values()], timeout=max(remaining, 0))
            if not ready:
                waiting = ", ".join(_label(rank) for rank in pending)
                first = next(iter(pending))
                raise ParityError(
                    f"timed out after {timeout:g} s (--timeout) with {waiting} still running, now killed: a collective"
                    " that one rank never reaches hangs the others, or the run needs more time. The last lines of"
                    f" {_label(first)}'s output:\n{_tail(workdir, first)}"
                )
            for rank, process in list(pending.items()):
                if process.sentinel in ready:
                    process.join()
                    del pending[rank]
                    if process.exitcode != 0:
                        raise _failure(workdir, rank, process.exitcode)
    finally:
        for process in processes.values():
            if process.is_alive():
                process.kill()
            process.join()
    return {_key(rank): torch.load(os.path.join(workdir, f"{_key(rank)}.pt")) for rank in ranks}


# ---------------------------------------------------------------- comparing
@dataclass
class Row:
    """One compared tensor or metric: the largest absolute difference, ``inf`` when it exists on one side only or
    the shapes differ (``note`` says which)."""

    name: str
    shape: str
    max_diff: float
    note: str = ""


def _tensor_rows(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> list[Row]:
    rows = []
    for name in [*reference, *(k for k in ours if k not in reference)]:
        if name not in ours or name not in reference:
            side = "the strategy run" if name not in ours else "the reference"
            tensor = reference.get(name, ours.get(name))
            rows.append(Row(name, str(tuple(tensor.shape)), math.inf, f"missing in {side}"))
        elif ours[name].shape != reference[name].shape:
            shapes = f"{tuple(ours[name].shape)} vs {tuple(reference[name].shape)}"
            rows.append(Row(name, str(tuple(reference[name].shape)), math.inf, f"shapes differ: {shapes}"))
        else:
            diff = (ours[name].double() - reference[name].double()).abs()
            rows.append(Row(name, str(tuple(reference[name].shape)), diff.max().item() if diff.numel() else 0.0))
    return rows


def _rank_mean(per_rank: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    """Each step's metrics averaged over the ranks that logged them."""
    steps = []
    for step in zip(*per_rank):
        keys = dict.fromkeys(k for metrics in step for k in metrics)
        steps.append({k: sum(m[k] for m in step if k in m) / sum(k in m for m in step) for k in keys})
    return steps


def _metric_rows(ours: list[dict[str, float]], reference: list[dict[str, float]]) -> list[Row]:
    names = dict.fromkeys(k for metrics in (*reference, *ours) for k in metrics)
    rows = []
    for name in names:
        diffs, missing = [], 0
        for mine, theirs in zip(ours, reference):
            if name in mine and name in theirs:
                diffs.append(abs(mine[name] - theirs[name]))
            elif name in mine or name in theirs:
                missing += 1
        note = f"logged by one run only at {missing} steps" if missing else ""
        worst = math.inf if missing else max(diffs, key=_severity, default=0.0)
        rows.append(Row(name, f"{len(reference)} steps", worst, note))
    return rows


def _severity(diff: float) -> float:
    """Sort key of a difference: nan (a nan on one side) ranks with inf, above every finite difference."""
    return math.inf if math.isnan(diff) else diff


def _within(row: Row, tolerance: float) -> bool:
    return row.max_diff <= tolerance  # False for nan


def compare(results: dict[str, dict[str, Any]], job: Job, tolerance: float) -> tuple[bool, list[Row], str]:
    """``(passed, rows, verdict line)`` for the results of :func:`run`."""
    reference = results[REFERENCE]
    ranks = [results[f"rank{r}"] for r in range(job.devices)]
    ran = {f"rank {r}": res["global_step"] for r, res in enumerate(ranks)} | {"the reference": reference["global_step"]}
    if any(steps != job.steps for steps in ran.values()):
        counts = ", ".join(f"{who} {steps}" for who, steps in ran.items())
        return False, [], f"FAIL: the runs did not all make {job.steps} optimizer steps ({counts}); nothing compared"
    rows = _tensor_rows(ranks[0]["state"], reference["state"])
    rows += _metric_rows(_rank_mean([res["metrics"] for res in ranks]), reference["metrics"])
    if not rows:
        return False, [], "FAIL: the module has no parameters or buffers and logged no train* metric; nothing compared"
    worst = max(rows, key=lambda row: _severity(row.max_diff))
    above = [row for row in rows if not _within(row, tolerance)]
    if not above:
        return (
            True,
            rows,
            f"PASS: {job.strategy} matches the single-process reference within {tolerance:g} on {job.steps} steps"
            f" (max diff {worst.max_diff:.1e} on {worst.name})",
        )
    detail = f"; {worst.note}" if worst.note else ""
    return (
        False,
        rows,
        f"FAIL: {job.strategy} differs from the single-process reference on {len(above)} of {len(rows)} tensors and"
        f" metrics beyond {tolerance:g} after {job.steps} steps (worst: {worst.name}, max diff"
        f" {worst.max_diff:.1e}{detail})",
    )


def table(rows: list[Row], tolerance: float) -> list[str]:
    """The rows as aligned text; above :data:`TABLE_ROWS` rows, the largest differences only, in model order."""
    shown = rows
    if len(rows) > TABLE_ROWS:
        keep = {id(row) for row in sorted(rows, key=lambda row: -_severity(row.max_diff))[:TABLE_ROWS]}
        shown = [row for row in rows if id(row) in keep]
    name_width = max(len("tensor"), *(len(row.name) for row in shown))
    shape_width = max(len("shape"), *(len(row.shape) for row in shown))
    lines = [f"{'tensor':<{name_width}}  {'shape':<{shape_width}}  max |diff|"]
    for row in shown:
        flag = "" if _within(row, tolerance) else "  > tolerance"
        note = f"  ({row.note})" if row.note else ""
        lines.append(f"{row.name:<{name_width}}  {row.shape:<{shape_width}}  {row.max_diff:.1e}{flag}{note}")
    if len(shown) < len(rows):
        hidden = len(rows) - len(shown)
        lines.append(f"... {hidden} more with smaller differences (--json has every row)")
    return lines


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None  # strict JSON has no inf or nan


def report(passed: bool, rows: list[Row], verdict: str, job: Job, tolerance: float, notes: list[str]) -> dict:
    """The ``--json`` document."""
    worst = max(rows, key=lambda row: _severity(row.max_diff), default=None)
    return {
        "verdict": "PASS" if passed else "FAIL",
        "message": verdict,
        "max_diff": _finite(worst.max_diff) if worst else None,
        "worst": worst.name if worst else None,
        "tolerance": tolerance,
        "job": asdict(job),
        "notes": notes,
        "rows": [{**asdict(row), "max_diff": _finite(row.max_diff)} for row in rows],
    }


# ---------------------------------------------------------------- console script
def _json_object(text: str, option: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ParityError(f"{option} {text!r}: not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ParityError(f"{option} {text!r}: expected a JSON object, got a {type(value).__name__}")
    return value


def _job(args: argparse.Namespace) -> Job:
    """Validate the arguments (cheap checks first) and build the job. Raises :class:`ParityError`."""
    if args.strategy not in StrategyRegistry:
        names = StrategyRegistry.available_strategies()
        raise ParityError(
            f"--strategy {args.strategy!r} is not a registered strategy{did_you_mean(args.strategy, names)} (the"
            f" registered ones: {', '.join(names)})"
        )
    for option, value, least in (("--devices", args.devices, 2), ("--steps", args.steps, 1)):
        if value < least:
            raise ParityError(f"{option} {value}: must be at least {least}")
    if args.batch_size is not None and args.batch_size < 1:
        raise ParityError(f"--batch-size {args.batch_size}: must be at least 1")
    if not args.tolerance >= 0:
        raise ParityError(f"--tolerance {args.tolerance:g}: must be a number >= 0")
    if not args.timeout > 0:
        raise ParityError(f"--timeout {args.timeout:g}: must be a positive number of seconds")
    if args.json and not Path(args.json).resolve().parent.is_dir():  # found out now, not after the runs
        raise ParityError(f"--json {args.json}: the folder {str(Path(args.json).resolve().parent)!r} does not exist")
    init_kwargs = _json_object(args.init_kwargs, "--init-kwargs")
    trainer_kwargs = _json_object(args.trainer_kwargs, "--trainer-kwargs")
    if refused := sorted(SET_BY_THE_CHECK & trainer_kwargs.keys()):
        raise ParityError(
            f"--trainer-kwargs may not set {', '.join(refused)}: the check sets these itself, the same in both runs"
        )
    module_cls = load_class(args.module, L.LightningModule, "MODULE:CLASS")
    datamodule_cls = load_class(args.datamodule, L.LightningDataModule, "--datamodule") if args.datamodule else None
    try:
        inspect.signature(module_cls).bind(**init_kwargs)
    except TypeError as err:
        raise ParityError(f"--init-kwargs {args.init_kwargs}: {module_cls.__qualname__}(...) {err}") from None
    _trains_from(module_cls, datamodule_cls)
    return Job(
        module=args.module,
        datamodule=args.datamodule,
        init_kwargs=init_kwargs,
        strategy=args.strategy,
        devices=args.devices,
        steps=args.steps,
        batch_size=args.batch_size,
        seed=args.seed,
        trainer_kwargs=trainer_kwargs,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0].replace("``", ""),
        epilog="Exit codes: 0 PASS, 1 FAIL, 2 the check could not be made.",
    )
    parser.add_argument(
        "module", metavar="MODULE:CLASS", help="your LightningModule: pkg.module:Class or file.py:Class"
    )
    parser.add_argument("--strategy", required=True, help="a registered strategy name, e.g. zero3_scratch or ddp")
    parser.add_argument("--devices", type=int, default=2, help="processes of the strategy run (default 2)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps of each run (default 5)")
    parser.add_argument("--batch-size", type=int, help="samples per rank and batch (default: the loader's)")
    parser.add_argument("--datamodule", metavar="MODULE:CLASS", help="a LightningDataModule to train from")
    parser.add_argument("--init-kwargs", default="{}", metavar="JSON", help="keyword arguments of CLASS(...)")
    parser.add_argument("--trainer-kwargs", default="{}", metavar="JSON", help="more arguments of both Trainers")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="largest absolute difference (default 1e-5)")
    parser.add_argument("--seed", type=int, default=0, help="seed_everything and the samplers' seed (default 0)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the runs may take (default 600)")
    parser.add_argument("--json", metavar="OUT", help="write every difference and the verdict to this file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The console script ``lightning-zero-parity``; returns the exit code (argparse exits with 2 by itself)."""
    args = _parser().parse_args(argv)
    try:
        job = _job(args)
        print(
            f"{PROG}: {args.module} under {job.strategy} on {job.devices} CPU processes and the single-process"
            f" reference, {job.steps} steps, seed {job.seed} (timeout {args.timeout:g} s) ...",
            file=sys.stderr,
        )
        with tempfile.TemporaryDirectory(prefix="lightning-zero-parity-") as workdir:
            results = run(job, workdir, args.timeout)
    except ParityError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    reference = results[REFERENCE]
    passed, rows, verdict = compare(results, job, args.tolerance)
    batch = reference["batch_size"]
    print(f"global batch {job.devices * batch} ({job.devices} ranks x {batch}), {job.steps} optimizer steps")
    if rows:
        print("\n".join(table(rows, args.tolerance)))
    for note in reference["notes"]:
        print(f"note: {note}")
    print(verdict)
    if args.json:
        document = report(passed, rows, verdict, job, args.tolerance, reference["notes"])
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    return EXIT_PASS if passed else EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
