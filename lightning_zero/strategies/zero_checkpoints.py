"""The engine a ZeRO fit builds, as the strategy holds it, and the strategy's checkpoint hooks over it.

:class:`ZeroCheckpointing` is the base of :class:`~lightning_zero.strategies.zero.ZeroStrategy`: it holds the
stage-1/2 or stage-3 engine (``engine``) and routes Lightning's checkpoint hooks through
:class:`~lightning_zero.zero.checkpointing.ZeroCheckpointer` ([Note: checkpoint layout] in
``lightning_zero/zero/checkpointing.py``), which the Fabric front end shares.

Checkpoints (``trainer.save_checkpoint`` is collective: call it on every rank, as Lightning's ``ModelCheckpoint`` does,
also after ``fit``; ``fit(ckpt_path=...)`` reads either kind, saved at any world size):

- ``state_dict_type="sharded"`` (default): a directory (:mod:`lightning_zero.zero.checkpoint`); each rank writes its own
  optimizer shard through ``torch.distributed.checkpoint``, the replicated weights are written once.
- ``state_dict_type="full"``: one plain file from rank 0: full weights and the optimizer state gathered into the
  format of the unsharded optimizer, so it loads with plain ``torch.load`` or ``LightningModule.load_from_checkpoint``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.strategies.base import ScratchParallelStrategy
from lightning_zero.zero.checkpointing import ZeroCheckpointer
from lightning_zero.zero.stage3.engine import ShardedParams
from lightning_zero.zero.stage12 import ShardedOptimizer


class ZeroCheckpointing(ScratchParallelStrategy):
    """The ZeRO engine of a fit and the checkpoints of it: the model's state dict, the optimizer's share of each rank,
    saving either kind and loading either kind at any world size. ``stage`` and ``state_dict_type`` are the
    subclass's settings."""

    stage: int
    state_dict_type: str

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._engine: ShardedOptimizer | None = None
        self._params: ShardedParams | None = None
        self._model_loaded = False  # load_checkpoint loaded the weights too

    @property
    def engine(self) -> ShardedOptimizer | ShardedParams | None:
        """The ZeRO engine of the current (or last) fit, else ``None``."""
        return self._params if self.stage == 3 else self._engine

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore into the flat buffers and the sharded optimizer, which exist only after setup."""
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizer shards itself

    def _checkpointer(self) -> ZeroCheckpointer:
        assert self.lightning_module is not None
        return ZeroCheckpointer(self.lightning_module, self.engine, sharded=self.state_dict_type == "sharded")

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Stage 3: the weights gathered (``"full"``, rank 0) or as per-parameter DTensors (``"sharded"``)."""
        return self._checkpointer().model_state()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's share of the optimizer state (collective: Lightning calls it on every rank when saving)."""
        checkpointer = self._checkpointer()
        if not checkpointer.has_optimizer:
            return super().optimizer_state(optimizer)
        return checkpointer.optimizer_state(checkpointer.index(optimizer))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """[Note: checkpoint layout] in ``lightning_zero/zero/checkpointing.py``."""
        write_full = super().save_checkpoint
        self._checkpointer().save(checkpoint, filepath, lambda full: write_full(full, filepath, storage_options))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Either kind, saved at any world size; the optimizer's shards, and the model where Lightning cannot load it
        (sharded checkpoints, stage 3), are loaded here."""
        read_full = self._load_full_file
        checkpoint, self._model_loaded = self._checkpointer().load(
            checkpoint_path, lambda p: read_full(p, weights_only)
        )
        return checkpoint

    def _load_full_file(self, path: Any, weights_only: bool | None) -> dict[str, Any]:
        """A full checkpoint, memory-mapped when it is a local file read by Lightning's default checkpoint IO: every
        rank reads only the pages of its own pieces, and the ranks of a host share them, instead of each rank
        loading every tensor."""
        if isinstance(self.checkpoint_io, TorchCheckpointIO) and os.path.isfile(path):
            return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
        return super().load_checkpoint(path, weights_only=weights_only)

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        # load_checkpoint already loaded a sharded checkpoint (in place), or any checkpoint into stage 3's shards.
        if not self._model_loaded:
            self._checkpointer().load_model(checkpoint["state_dict"], strict)
