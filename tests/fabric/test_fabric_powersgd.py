"""Fabric's ``ddp_scratch`` with ``grad_compression="powersgd"``: ``fabric.save`` carries every rank's compressor state
and ``fabric.load`` puts it back, so save, a fresh setup, load and continue equals the straight run bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch import nn
from torch.nn import functional as F

import lightning_zero
from lightning_zero.comm.powersgd import CHECKPOINT_KEY
from tests.helpers.workers import run_workers

WORLD, STEPS, SAVE_AT = 2, 5, 3
POWERSGD = {"rank": 1, "start_iter": 1}


def _net() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _steps(fabric: Fabric, first: int, last: int, path: str | None = None, resume: str | None = None) -> dict:
    """A fresh model set up; ``resume`` loaded; steps ``first .. last - 1``; saved to ``path``."""
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer}
    remainder = fabric.load(resume, state) if resume is not None else {}
    for step in range(first, last):
        g = torch.Generator().manual_seed(100 * step + fabric.global_rank)
        x = torch.randn(4, 6, generator=g)
        fabric.backward(F.mse_loss(model(x), x[:, :1] - x[:, 1:2]))
        optimizer.step()
        optimizer.zero_grad()
    if path is not None:
        fabric.save(path, state)
    return {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "iteration": fabric.strategy.engine.compressor.iteration,
        "remainder": sorted(remainder),
    }


def _runs(directory: str) -> dict:
    strategy = lightning_zero.fabric.ScratchDDPStrategy(grad_compression="powersgd", powersgd=POWERSGD)
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    out = {"straight": _steps(fabric, 0, STEPS)}
    path, stateless = f"{directory}/psgd.ckpt", f"{directory}/stateless.ckpt"
    _steps(fabric, 0, SAVE_AT, path=path)
    out["resumed"] = _steps(fabric, SAVE_AT, STEPS, resume=path)
    if dist.get_rank() == 0:
        checkpoint = torch.load(path, weights_only=True)
        out["saved_keys"] = sorted(checkpoint)
        del checkpoint[CHECKPOINT_KEY]
        torch.save(checkpoint, stateless)
    dist.barrier()
    out["stateless"] = _steps(fabric, SAVE_AT, STEPS, resume=stateless)
    return out


@pytest.mark.timeout(240)
def test_save_load_continue_equals_the_straight_run(tmp_path):
    runs = run_workers(_runs, WORLD, str(tmp_path), timeout=180)
    assert CHECKPOINT_KEY in runs[0]["saved_keys"]
    for rank_runs in runs:
        straight, resumed, stateless = rank_runs["straight"], rank_runs["resumed"], rank_runs["stateless"]
        assert resumed["iteration"] == straight["iteration"] == STEPS
        assert resumed["remainder"] == []  # the compressor's entry is the strategy's, not handed back
        for key, value in straight["weights"].items():
            assert torch.equal(value, resumed["weights"][key]), key
        # without the entry: a fresh compressor (counting from 0, its first step plain), another trajectory
        assert stateless["iteration"] == STEPS - SAVE_AT
        assert any(not torch.equal(stateless["weights"][k], straight["weights"][k]) for k in straight["weights"])
