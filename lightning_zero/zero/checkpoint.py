"""Sharded checkpoints: a ``torch.distributed.checkpoint`` (DCP) directory plus ``meta.pt``, written atomically.

Layout (the one Lightning's FSDP strategy uses, so Lightning recognises it as a sharded checkpoint)::

    PATH/                 a directory
      __0_0.distcp ...    DCP shards of every tensor: "model" (replicated, written once) and "optimizer_0"
      .metadata           DCP's index: global shape of every tensor and which file holds which chunk
      meta.pt             everything else, saved by rank 0 with torch.save (loops, schedulers, hyper-parameters)

DCP records each tensor's global shape and the chunk each rank wrote, so a checkpoint saved by N ranks loads on M
ranks: every rank reads the chunks overlapping the part it owns.

A save goes to ``PATH.partial`` and replaces ``PATH`` only once every rank has finished, so a failed save never
corrupts the last good checkpoint at ``PATH``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from lightning_zero.comm import collectives as comm

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
        torch.save(meta, partial / META_FILE)
    comm.barrier(tag="checkpoint")
    if comm.rank() == 0:
        previous = path.with_name(path.name + ".previous")
        shutil.rmtree(previous, ignore_errors=True)
        if path.exists():
            path.rename(previous)
        partial.rename(path)
        shutil.rmtree(previous, ignore_errors=True)
    comm.barrier(tag="checkpoint")


def read_metadata(path: str | Path) -> Metadata:
    """DCP's index of a sharded checkpoint: ``state_dict_metadata`` maps flattened keys to global shapes."""
    return dcp.FileSystemReader(str(path)).read_metadata()


def load_sharded(path: str | Path, tensors: dict[str, Any]) -> dict[str, Any]:
    """Load into ``tensors`` in place (each rank reads what its templates cover); return ``meta.pt``."""
    dcp.load(tensors, checkpoint_id=str(path))
    return torch.load(Path(path) / META_FILE, weights_only=False)
