"""Sharded checkpoints: a ``torch.distributed.checkpoint`` (DCP) directory plus ``meta.pt``, written atomically.

Layout (the one Lightning's FSDP strategy uses, so Lightning recognises it as a sharded checkpoint)::

    PATH/                 a directory
      __0_0.distcp ...    DCP shards of every tensor: "model" (replicated, written once) and "optimizer_0"
      .metadata           DCP's index: global shape of every tensor and which file holds which chunk
      meta.pt             everything else, saved by rank 0 with torch.save (loops, schedulers, hyper-parameters)

DCP records each tensor's global shape and the chunk each rank wrote, so a checkpoint saved by N ranks loads on M
ranks: every rank reads the chunks overlapping the part it owns.

A save goes to ``PATH.partial`` and replaces ``PATH`` only once every rank has finished, so a failed save never
corrupts the last good checkpoint at ``PATH``; ``meta.pt`` is written last (DCP's ``.metadata`` is written once every
rank's shards are), so a directory with both is complete. The old checkpoint is moved aside as ``<stem>.previous.ckpt``
for the two renames that replace it: a kill between them leaves that name, which Lightning's ``ckpt_path="last"``
still finds (``last.previous.ckpt``), and never a directory without a checkpoint.

Before loading, :func:`verify` checks every file DCP's index names against the bytes it needs, so a missing or
truncated shard is refused with the file and the tensor, before any weight changes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from lightning_zero.comm import collectives as comm
from lightning_zero.training.checkpoint_checks import CheckpointError, reading

META_FILE = "meta.pt"


def is_sharded_checkpoint(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / META_FILE).is_file()


def save_sharded(path: str | Path, tensors: dict[str, Any], meta: dict[str, Any]) -> None:
    """Save ``tensors`` (nested dicts of tensors/DTensors) with DCP and ``meta`` with ``torch.save`` (collective)."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    if comm.rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # debris of an earlier failed save
    comm.barrier(tag="checkpoint")
    dcp.save(tensors, checkpoint_id=partial)
    if comm.rank() == 0:
        torch.save(meta, partial / (META_FILE + ".tmp"))
        os.replace(partial / (META_FILE + ".tmp"), partial / META_FILE)  # a kill mid-write leaves no meta.pt
    comm.barrier(tag="checkpoint")
    if comm.rank() == 0:
        previous = path.with_name(f"{path.stem}.previous{path.suffix}")
        shutil.rmtree(previous, ignore_errors=True)
        if path.exists():
            path.rename(previous)
        partial.rename(path)
        shutil.rmtree(previous, ignore_errors=True)
    comm.barrier(tag="checkpoint")


def read_metadata(path: str | Path) -> Metadata:
    """DCP's index of a sharded checkpoint: ``state_dict_metadata`` maps flattened keys to global shapes."""
    with reading(path, "sharded checkpoint"):
        if not (Path(path) / ".metadata").is_file():
            raise CheckpointError(f"sharded checkpoint {path} has no DCP index (.metadata): its save did not finish")
        return dcp.FileSystemReader(str(path)).read_metadata()


def verify(path: str | Path, metadata: Metadata) -> None:
    """Every shard file the index names holds the bytes it needs, or a :class:`CheckpointError` names it."""
    sizes: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        file = Path(path) / info.relative_path
        if info.relative_path not in sizes:
            sizes[info.relative_path] = file.stat().st_size if file.is_file() else -1
        size = sizes[info.relative_path]
        if size < 0:
            raise CheckpointError(
                f"sharded checkpoint {path} is missing shard file {info.relative_path} (it holds tensor {index.fqn!r})"
            )
        if size < info.offset + info.length:
            raise CheckpointError(
                f"sharded checkpoint {path}: shard file {info.relative_path} is truncated ({size} bytes, but tensor"
                f" {index.fqn!r} needs bytes {info.offset}..{info.offset + info.length})"
            )


def read_meta(path: str | Path) -> dict[str, Any]:
    """``meta.pt``: everything of a sharded checkpoint but its tensors."""
    with reading(Path(path) / META_FILE):
        return torch.load(Path(path) / META_FILE, map_location="cpu", weights_only=False)


def load_tensors(path: str | Path, tensors: dict[str, Any]) -> None:
    """Load into ``tensors`` in place (each rank reads what its templates cover), every shard file checked against
    the index first, so a missing or truncated one changes nothing."""
    verify(path, read_metadata(path))
    with reading(path, "sharded checkpoint"):
        dcp.load(tensors, checkpoint_id=str(path))


def load_sharded(path: str | Path, tensors: dict[str, Any]) -> dict[str, Any]:
    """:func:`read_meta`, then :func:`load_tensors`: a checkpoint whose ``meta.pt`` is unreadable changes nothing."""
    meta = read_meta(path)
    load_tensors(path, tensors)
    return meta
