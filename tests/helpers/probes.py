"""Callbacks that record what a fit communicated."""

from __future__ import annotations

from lightning.pytorch import Callback

from lightning_zero.comm.collectives import LEDGER


class LedgerPerBatch(Callback):
    """The ledger records of each training batch (forward, backward and any optimizer step)."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[str, str, int]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = len(LEDGER.records)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append(list(LEDGER.records[self._start :]))
