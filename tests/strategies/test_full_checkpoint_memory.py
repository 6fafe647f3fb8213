"""A full checkpoint (``state_dict_type="full"``) of a ZeRO model must not materialise the model on every rank.

Rank 0 writes the file: it gathers one unit (ZeRO-3) or one parameter (ZeRO-1/2) at a time and keeps a CPU copy;
every other rank only lends its pieces, so its extra memory while saving is at most about one unit. Measured as the
rise of the process's peak resident memory (``VmHWM``, reset through ``/proc/self/clear_refs``) during
``trainer.save_checkpoint``, with glibc returning large blocks at once (``MALLOC_MMAP_THRESHOLD_``), in processes
started by :func:`tests.helpers.workers.run_workers`. Before this rule each rank gathered every parameter and every
optimizer moment: +12Ψ bytes per rank.

Loading one is the mirror image: the file is memory-mapped and each rank copies only its pieces into its shards. The
pages of the file a rank reads count in its resident memory but are the page cache's, shared by the ranks and
reclaimable, so the load is measured as the peak rise *less* the rise of file-backed resident memory (``RssFile``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_zero import ZeroStrategy
from tests.helpers.parity import quiet_trainer
from tests.helpers.workers import run_workers

WIDTH, BLOCKS = 512, 8
UNIT_BYTES = 4 * (WIDTH * WIDTH + WIDTH)  # one Linear block in fp32
MiB = 2**20


class Blocks(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS)))

    def training_step(self, batch, batch_idx):
        return self.blocks(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _save_peak(stage: int, path: str) -> dict:
    torch.manual_seed(0)
    module = Blocks()
    trainer = quiet_trainer(ZeroStrategy(stage=stage, state_dict_type="full"), max_steps=1)
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(8, WIDTH)), batch_size=2))
    before = _kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    trainer.save_checkpoint(path)
    return {"extra": _kib("VmHWM") - before, "rank": trainer.global_rank}


class _MeasuredLoad(ZeroStrategy):
    """Records the memory that ``load_checkpoint`` (the file, the model pieces under ZeRO-3, the optimizer pieces)
    adds beyond what it reads from the page cache."""

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        before, file_before = _kib("VmRSS"), _kib("RssFile")
        Path("/proc/self/clear_refs").write_text("5")
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        self.load_extra = _kib("VmHWM") - before - (_kib("RssFile") - file_before)
        return checkpoint


def _load_peak(stage: int, path: str) -> dict:
    data = DataLoader(TensorDataset(torch.randn(8, WIDTH)), batch_size=2)
    torch.manual_seed(0)
    trainer = quiet_trainer(ZeroStrategy(stage=stage, state_dict_type="full"), max_steps=1)
    trainer.fit(Blocks(), data)
    trainer.save_checkpoint(path)
    strategy = _MeasuredLoad(stage=stage, state_dict_type="full")
    trainer = quiet_trainer(strategy, max_steps=2)
    trainer.fit(Blocks(), data, ckpt_path=path)
    return {"extra": strategy.load_extra, "rank": trainer.global_rank}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [2, 3])
def test_loading_builds_only_this_ranks_optimizer_state(tmp_path, monkeypatch, stage):
    """Each rank's extra memory while loading is its own shard of AdamW's moments (8Ψ/N, created by the load) plus
    about one block, not the whole optimizer state (8Ψ) or the whole file (12Ψ) as a plain ``torch.load`` gives."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    results = run_workers(_load_peak, 2, stage, str(tmp_path / "full.ckpt"), timeout=500, start_method="spawn")
    psi = BLOCKS * (WIDTH * WIDTH + WIDTH)
    for result in results:
        assert result["extra"] <= 8 * psi / 2 + 2 * UNIT_BYTES + 4 * MiB, (result["extra"] / MiB, 8 * psi / MiB)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [2, 3])
def test_only_rank_zero_holds_the_full_state_while_saving(tmp_path, monkeypatch, stage):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # read by the workers' glibc at start
    path = str(tmp_path / "full.ckpt")
    results = run_workers(_save_peak, 2, stage, path, timeout=500, start_method="spawn")
    psi = BLOCKS * (WIDTH * WIDTH + WIDTH)
    full_state = 12 * psi  # fp32 weights + AdamW's two moments: what a rank gathering everything would hold
    lender = next(r for r in results if r["rank"] == 1)
    assert lender["extra"] <= 2 * UNIT_BYTES + 4 * MiB, (lender["extra"] / MiB, full_state / MiB)
    checkpoint = torch.load(path, weights_only=False)
    assert set(checkpoint["state_dict"]) == {f"blocks.{i}.{k}" for i in range(BLOCKS) for k in ("weight", "bias")}
    assert len(checkpoint["optimizer_states"][0]["state"]) == 2 * BLOCKS
    assert os.path.getsize(path) >= full_state
