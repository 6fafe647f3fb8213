"""Running a ``lightning-zero-parity`` job (:mod:`lightning_zero.tools.parity`): the strategy's processes and the
one-process reference, each fitting the user's module with its loader replaced (every rank's share of each batch,
or the whole global batch), recording the metrics of every optimizer step; launched together under a timeout, with
the last lines of a failed process's output in the error.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.multiprocessing as mp
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.pytorch.utilities.seed import isolate_rng
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from lightning_zero.tools.parity_job import (
    DIST_VARS,
    EXIT_ERROR,
    LOG_TAIL_LINES,
    METRIC_PREFIX,
    PRELOAD,
    REFERENCE,
    GlobalBatchSampler,
    Job,
    ParityError,
    load_class,
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
    for var in DIST_VARS:
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
