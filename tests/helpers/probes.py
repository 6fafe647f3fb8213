"""Callbacks that record what a fit communicated."""

from __future__ import annotations

from lightning.pytorch import Callback

from lightning_zero.comm.collectives import LEDGER
from lightning_zero.training.memory import model_state_bytes


class LedgerPerBatch(Callback):
    """The ledger records of each training batch (forward, backward and any optimizer step)."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[str, str, int]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = len(LEDGER.records)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append(list(LEDGER.records[self._start :]))


class ModelStateProbe(LedgerPerBatch):
    """Also, at the end of fit (between steps): ``memory``, this rank's model-state bytes under a ZeRO engine
    (module parameters plus the engine's shards, optimizer state, the engine's buffers), and ``psi``, the trainable
    elements."""

    def on_train_end(self, trainer, pl_module):
        engine = trainer.strategy.engine
        params = list(pl_module.parameters()) + engine.shard_params
        self.memory = model_state_bytes(params, trainer.optimizers, engine.strategy_buffers)
        self.psi = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
