"""Fabric loops on Lightning's demo Transformer (``lightning.pytorch.demos.Transformer``) and under mixed precision,
every strategy against Fabric's own ``ddp`` in the same run (same seed, same data per rank).

The demo model trains with dropout 0 and the optimizer of Lightning's ``LightningTransformer`` (SGD, lr 0.1), with
gradient accumulation through ``no_backward_sync`` and global-norm clipping. (Not Adam: the attention's key bias has
an analytically zero gradient, so its computed gradient is rounding noise, which Adam normalises to steps of size
``lr``; rounding differences of the clipping norm, summed per shard under ZeRO, then show as differences of 1e-3.)

- ``32-true`` and ``bf16-mixed`` (ZeRO with ``param_dtype=None``: autocast then computes the same operations under
  every strategy): the weights agree within float summation order.
- The low-precision defaults, compared by loss curve within bf16 rounding: ``bf16-true`` keeps fp32 master weights
  under our strategies where Fabric's ``ddp`` updates bf16 parameters, and ZeRO rounds the parameters it gathers to
  bf16 under ``bf16-mixed``.
"""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.demos import Transformer
from torch.nn import functional as F

import lightning_zero
from tests.fabric.test_fabric_checkpoint import _weights
from tests.helpers.equivalence import max_diff
from tests.helpers.workers import run_workers

WORLD, STEPS, ACCUM, CLIP = 2, 2, 2, 0.5
VOCAB, LENGTH, BATCH = 37, 8, 2
TOLERANCE, LOSS_TOLERANCE = 1e-5, 2e-2
ZERO = ("zero1_scratch", "zero2_scratch", "zero3_scratch")
OURS = ("ddp_scratch", "robust_ddp_scratch", *ZERO)  # robust: its default rule, the mean, is data parallelism


def _tokens(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _strategy(name: str, exact: bool):
    """``exact``: ZeRO computes with the parameters' own values (``param_dtype=None``), as autocast does; by default
    ZeRO rounds the parameters it gathers to bf16 under ``bf16-mixed``."""
    if exact and name.startswith("zero"):
        return lightning_zero.fabric.ZeroStrategy(stage=int(name[4]), param_dtype=None)
    return name


def _demo_loop(name: str, precision: str = "32-true", exact: bool = True) -> dict:
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=_strategy(name, exact), precision=precision)
    fabric.launch()
    torch.manual_seed(0)
    model = Transformer(vocab_size=VOCAB, ninp=16, nhead=2, nhid=32, nlayers=1, dropout=0.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # LightningTransformer's optimizer
    model, optimizer = fabric.setup(model, optimizer)
    losses = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            inputs, target = _tokens(fabric.global_rank, step, micro)
            with fabric.no_backward_sync(model, enabled=micro < ACCUM - 1):
                loss = F.nll_loss(model(inputs, target).float(), target.reshape(-1))
                fabric.backward(loss / ACCUM)
            losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
    return {"weights": {k: v.float() for k, v in _weights(fabric, model).items()}, "losses": losses}


def _all() -> dict:
    out = {}
    for precision in ("32-true", "bf16-mixed", "bf16-true"):
        for name in ("ddp", *OURS):
            out[name, precision] = _demo_loop(name, precision)
    for name in ZERO:
        out[name, "bf16-mixed", "default"] = _demo_loop(name, "bf16-mixed", exact=False)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_workers(_all, WORLD, timeout=400)


@pytest.mark.timeout(450)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("name", OURS)
def test_demo_transformer_equals_fabric_ddp(runs, name, precision):
    for rank_runs in runs:
        ours, peer = rank_runs[name, precision], rank_runs["ddp", precision]
        assert max_diff(ours["weights"], peer["weights"]) <= TOLERANCE
        assert ours["losses"] == pytest.approx(peer["losses"], abs=TOLERANCE)
    start = runs[0]["ddp", precision]["losses"]
    assert start[-1] < start[0]  # it trained


@pytest.mark.timeout(450)
@pytest.mark.parametrize("key", [*((n, "bf16-true") for n in OURS), *((n, "bf16-mixed", "default") for n in ZERO)])
def test_low_precision_defaults_follow_fabric_ddp_loss_curve(runs, key):
    """Master weights under ``bf16-true``, and ZeRO's bf16 parameters under ``bf16-mixed``: bf16 rounding apart."""
    ours, peer = runs[0][key]["losses"], runs[0]["ddp", key[1]]["losses"]
    assert max(abs(a - b) for a, b in zip(ours, peer)) <= LOSS_TOLERANCE, (ours, peer)
    assert ours[-1] < ours[0]
