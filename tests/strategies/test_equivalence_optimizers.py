"""Optimizers that are not ``torch.optim``'s, against Lightning's ``ddp``: ZeRO shards only what it knows to be
elementwise, refuses the rest by name, and trains sharpness-aware minimisation through ``lightning_zero.optim.SAM``.

ZeRO steps each rank's shard on its own ([Note: elementwise optimizers] in ``lightning_zero/zero/partition.py``). A SAM
written the usual way takes the gradient norm of what it holds (a shard) and perturbs only its shard, so it trains
differently (first losses 0.4089 and 0.4542 against ``ddp``'s 0.4282 before this was refused): it must be refused,
and ``lightning_zero.optim.SAM``, which takes the norm across the shards, must train as ``ddp``.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.optim import Optimizer
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero.optim
from tests.helpers.equivalence import OURS, Recorder, make_strategy, max_diff, state_of
from tests.helpers.parity import quiet_trainer
from tests.helpers.workers import run_workers

TOLERANCE = 1e-5
SEED = 7
WORLD = 2
ZERO = [name for name in OURS if "zero" in name]


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(1234)
    return DataLoader(TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g)), batch_size=4)


class UsualSAM(Optimizer):
    """SAM as it is usually written: the gradient norm over what the optimizer holds, a step to ``w + e``, the closure
    again, back to ``w``, the base step."""

    def __init__(self, params, rho: float = 0.05, lr: float = 0.1) -> None:
        super().__init__(params, {"rho": rho, "lr": lr})
        self.base = torch.optim.SGD(self.param_groups, lr=lr)

    @torch.no_grad()
    def step(self, closure):
        torch.enable_grad()(closure)()
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.norm(torch.stack([g.norm(2) for g in grads]), 2)
        moved = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    e = p.grad * group["rho"] / (norm + 1e-12)
                    p.add_(e)
                    moved.append((p, e))
        self.zero_grad()
        torch.enable_grad()(closure)()
        for p, e in moved:
            p.sub_(e)
        self.base.step()


class PlainSGD(Optimizer):
    """An elementwise optimizer of the user's own (plain SGD)."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        loss = torch.enable_grad()(closure)() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
        return loss


class Net(L.LightningModule):
    def __init__(self, make_optimizer) -> None:
        super().__init__()
        self.make_optimizer = make_optimizer
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)])
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.head = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x = batch[0]
        for block in self.blocks:
            x = block(x)
        loss = F.mse_loss(self.head(torch.tanh(self.frozen(x))), batch[1])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return self.make_optimizer([p for p in self.parameters() if p.requires_grad])


def _sam_sgd(params):
    return lightning_zero.optim.SAM(params, torch.optim.SGD, rho=0.05, lr=0.1, momentum=0.9)


def _sam_adamw(params):
    return lightning_zero.optim.SAM(params, torch.optim.AdamW, rho=0.1, lr=0.02, weight_decay=0.1)


CASES = {
    # name: (optimizer factory, strategy kwargs for the ZeRO stages)
    "sam_sgd": (_sam_sgd, {}),
    "sam_adamw": (_sam_adamw, {}),
    "usual_sam": (UsualSAM, {}),
    "usual_sam_declared": (UsualSAM, {"elementwise_optimizers": {UsualSAM}}),
    "plain_sgd": (PlainSGD, {}),
    "plain_sgd_declared": (PlainSGD, {"elementwise_optimizers": {PlainSGD}}),
}


def _fit(case: str, name: str) -> dict:
    make_optimizer, zero_kwargs = CASES[case]
    L.seed_everything(SEED, verbose=False)
    module, recorder = Net(make_optimizer), Recorder()
    strategy = make_strategy(name, **(zero_kwargs if name in ZERO else {}))
    trainer = quiet_trainer(strategy, max_epochs=1, limit_train_batches=5, callbacks=[recorder])
    try:
        trainer.fit(module, _loader())
    except (RuntimeError, ValueError) as error:
        return {"error": str(error)}
    return {"state": state_of(module), "steps": recorder.steps}


def _all_fits() -> dict:
    torch.set_num_threads(1)
    return {(case, name): _fit(case, name) for case in CASES for name in ("ddp", *OURS)}


@pytest.fixture(scope="module")
def fits():
    return run_workers(_all_fits, WORLD, timeout=600)


def _assert_as_ddp(fits: list[dict], case: str, name: str) -> None:
    for rank in range(WORLD):
        ours, peer = fits[rank][case, name], fits[rank][case, "ddp"]
        assert "error" not in ours, ours["error"]
        assert max_diff(ours["state"], peer["state"]) <= TOLERANCE, rank
        assert len(ours["steps"]) == len(peer["steps"]) == 5
        for mine, theirs in zip(ours["steps"], peer["steps"]):
            assert math.isclose(mine["train_loss"], theirs["train_loss"], abs_tol=TOLERANCE), (mine, theirs)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", ["sam_sgd", "sam_adamw"])
@pytest.mark.parametrize("name", OURS)
def test_lightning_zero_sam_trains_as_under_ddp(fits, case, name):
    """``lightning_zero.optim.SAM`` (base SGD with momentum, or AdamW; a frozen layer beside) under every strategy:
    the weights and the loss of every step as under ``ddp``; under ``ddp`` it is the usual SAM."""
    _assert_as_ddp(fits, case, name)


@pytest.mark.timeout(900)
def test_lightning_zero_sam_is_the_usual_sam_under_ddp(fits):
    """Under ``ddp`` (no sharding) ``lightning_zero.optim.SAM`` with SGD steps exactly as the usual implementation."""
    for rank in range(WORLD):
        usual, ours = fits[rank]["usual_sam", "ddp"], fits[rank]["sam_sgd", "ddp"]
        assert max_diff(usual["state"], ours["state"]) > 1e-4  # momentum 0.9 here: a different base optimizer
    # Without momentum the two are the same algorithm.
    L.seed_everything(SEED, verbose=False)
    a = Net(lambda params: lightning_zero.optim.SAM(params, torch.optim.SGD, rho=0.05, lr=0.1))
    L.seed_everything(SEED, verbose=False)
    b = Net(UsualSAM)
    for module in (a, b):
        quiet_trainer("auto", devices=1, max_epochs=1, limit_train_batches=3).fit(module, _loader())
    assert max_diff(state_of(a), state_of(b)) <= 1e-6


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", OURS)
def test_an_optimizer_zero_does_not_know_is_refused_naming_it(fits, name):
    """The usual SAM and a plain SGD of the user's own: the strategies that keep whole parameters train them as
    ``ddp``; ZeRO refuses both at setup, naming the class, the declaration and ``lightning_zero.optim.SAM``. Declared
    elementwise, the plain SGD trains as ``ddp``, and the SAM is stopped when it evaluates the closure a second time,
    naming it."""
    for case in ("usual_sam", "plain_sgd"):
        if name not in ZERO:
            _assert_as_ddp(fits, case, name)
            continue
        error = fits[0][case, name]["error"]
        kind = "UsualSAM" if case == "usual_sam" else "PlainSGD"
        assert f"{kind} is not an optimizer ZeRO knows" in error, error
        assert f"elementwise_optimizers={{{kind}}}" in error and "lightning_zero.optim.SAM" in error
    if name not in ZERO:
        return
    _assert_as_ddp(fits, "plain_sgd_declared", name)
    error = fits[0]["usual_sam_declared", name]["error"]
    assert error.startswith(f"UsualSAM evaluated the closure a second time in one step under {name}"), error
    assert "lightning_zero.optim.SAM" in error
