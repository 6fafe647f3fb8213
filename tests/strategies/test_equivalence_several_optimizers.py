"""Several optimizers under manual optimization against Lightning's ``ddp``: each ZeRO stage shards each optimizer on
its own, and an optimizer's ``zero_grad`` drops its gradients wherever the engine keeps them.

Under ``ddp`` an optimizer's parameters hold their gradients in ``p.grad`` until *that* optimizer's ``zero_grad``: a
GAN written as Lightning's manual-optimization docs write it lets the generator's backward add into the
discriminator's gradients, and relies on the discriminator's ``zero_grad`` to drop them. ZeRO keeps them in storage
of its own (stage 1's full flat gradient, a window's buckets, the shard accumulator), so each optimizer's
``zero_grad`` must reach it ([Note: zero_grad reaches the engine] in ``lightning_zero/optim/sharding.py``); and one
optimizer may step every batch while the other accumulates, so each has an accumulation window of its own. Before
this, stage 1 trained the docs' GAN 0.25 away from ``ddp``, and a discriminator accumulating over two generator steps
through ``toggle_model(sync_grad=...)`` 0.03 (stage 1) and 0.11 (stage 2, ``grad_sync="boundary"``) away.
"""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import ManualOptimBoringModel, RandomDataset
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero.tools import ckpt
from lightning_zero.zero.checkpointing import OPTIMIZERS
from tests.helpers.equivalence import OURS, Recorder, make_strategy, max_diff, state_of
from tests.helpers.parity import quiet_trainer
from tests.helpers.workers import run_workers

TOLERANCE = 1e-5
BF16_TOLERANCE = 0.02  # bf16-true: Lightning's ddp steps bf16 weights, ours fp32 masters (0.002-0.004 apart here)
SEED = 7
WORLD = 2
MANUAL = [name for name in OURS if not name.startswith("robust")]  # robust: automatic optimization only
ZERO = [name for name in MANUAL if "zero" in name]
GRAD_SYNC = {"zero1_scratch": "microbatch", "zero2_scratch": "boundary", "zero3_scratch": "boundary"}
"""Each stage's other gradient storage ([Note: tensor roles] in ``lightning_zero/zero/stage12.py``)."""


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(1234)
    return DataLoader(TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g)), batch_size=4)


def _accumulate_discarding_the_third(module: L.LightningModule, opt, loss: torch.Tensor, batch_idx: int) -> None:
    """Accumulate ``loss`` over two batches (no communication on the first); the third batch's gradients are thrown
    away by ``zero_grad`` inside its window (a bad micro-batch skipped), so the fourth steps alone."""
    boundary = batch_idx % 2 == 1
    with opt.toggle_model(sync_grad=boundary):
        module.manual_backward(loss / 2)
    if boundary:
        opt.step()
    if boundary or batch_idx == 2:
        opt.zero_grad()


class _Players(L.LightningModule):
    """A generator and a discriminator, two optimizers, manual optimization."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))

    def _noise(self, real, batch_idx):
        z = torch.randn(real.shape[0], 4, generator=torch.Generator().manual_seed(batch_idx))
        return z, torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)

    def _d_loss(self, real, fake, ones, zeros):
        loss = F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
        return loss + F.binary_cross_entropy_with_logits(self.discriminator(fake), zeros)


class GAN(_Players):
    """Each step toggled with ``toggle_optimizer``, the discriminator's gradients clipped with
    ``self.clip_gradients``, an LR scheduler each."""

    def training_step(self, batch, batch_idx):
        real = batch[0]
        g_opt, d_opt = self.optimizers()
        z, ones, zeros = self._noise(real, batch_idx)
        self.toggle_optimizer(g_opt)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(z)), ones)
        self.manual_backward(g_loss)
        g_opt.step()
        g_opt.zero_grad()
        self.untoggle_optimizer(g_opt)
        self.toggle_optimizer(d_opt)
        d_loss = self._d_loss(real, self.generator(z).detach(), ones, zeros)
        self.manual_backward(d_loss)
        self.clip_gradients(d_opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        d_opt.step()
        d_opt.zero_grad()
        self.untoggle_optimizer(d_opt)
        for scheduler in self.lr_schedulers():
            scheduler.step()
        self.log("train_loss", g_loss + d_loss)

    def configure_optimizers(self):
        g_opt = torch.optim.Adam(self.generator.parameters(), lr=0.01, betas=(0.5, 0.9))
        d_opt = torch.optim.AdamW(self.discriminator.parameters(), lr=0.02, weight_decay=0.1)
        schedulers = [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) for opt in (g_opt, d_opt)]
        return [g_opt, d_opt], schedulers


class ZeroGradGAN(_Players):
    """The ways a GAN's gradients are dropped by ``zero_grad``, no ``toggle_optimizer`` unless said:

    - ``"docs"``: as Lightning's manual-optimization docs: ``zero_grad`` before each backward, the generator's loss
      backpropagated through the discriminator (whose gradients the next ``d_opt.zero_grad()`` drops);
    - ``"accumulate"``: the discriminator accumulates over two batches (``toggle_model(sync_grad=boundary)``, no
      communication in between) while the generator steps every batch;
    - ``"discard"``: the discriminator alone, accumulating over two batches (no communication on the first); the
      third batch's gradients are thrown away by ``zero_grad`` in the middle of its window (a bad micro-batch
      skipped, while ``grad_sync="boundary"`` keeps the window's gradients unreduced), so the fourth steps alone.
    """

    def __init__(self, way: str) -> None:
        super().__init__()
        self.way = way

    def training_step(self, batch, batch_idx):
        real = batch[0]
        g_opt, d_opt = self.optimizers()
        z, ones, zeros = self._noise(real, batch_idx)
        fake = self.generator(z)
        d_loss = self._d_loss(real, fake.detach(), ones, zeros)
        self.log("train_d_loss", d_loss)
        if self.way == "discard":
            return _accumulate_discarding_the_third(self, d_opt, d_loss, batch_idx)
        if self.way in ("accumulate", "accumulate_bypassing"):
            boundary = batch_idx % 2 == 1
            with d_opt.toggle_model(sync_grad=boundary):
                self.manual_backward(d_loss / 2)
            if boundary:
                d_opt.step()
                d_opt.zero_grad()
            with g_opt.toggle_model():
                g_opt.zero_grad()
                g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(z)), ones)
                g_loss.backward() if self.way == "accumulate_bypassing" else self.manual_backward(g_loss)
                g_opt.step()
            return
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        g_opt.zero_grad()
        self.manual_backward(F.binary_cross_entropy_with_logits(self.discriminator(fake), ones))
        g_opt.step()

    def configure_optimizers(self):
        g_opt = torch.optim.Adam(self.generator.parameters(), lr=0.01)
        if self.way == "discard":
            return g_opt, torch.optim.AdamW(self.discriminator.parameters(), lr=0.05)
        return g_opt, torch.optim.SGD(self.discriminator.parameters(), lr=0.05, momentum=0.9)


class DiscardingBoring(ManualOptimBoringModel):
    """Lightning's manual-optimization demo model under :func:`_accumulate_discarding_the_third`, with an SGD with
    momentum."""

    def training_step(self, batch, batch_idx):
        loss = self.step(batch)
        self.log("train_loss", loss)
        _accumulate_discarding_the_third(self, self.optimizers(), loss, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=0.1, momentum=0.9)


def _boring_fit(name: str, grad_sync: str | None) -> dict:
    L.seed_everything(SEED, verbose=False)
    module, recorder = DiscardingBoring(), Recorder()
    strategy = make_strategy(name, **({"grad_sync": grad_sync} if grad_sync else {}))
    trainer = quiet_trainer(strategy, max_epochs=1, limit_train_batches=6, callbacks=[recorder])
    trainer.fit(module, DataLoader(RandomDataset(32, 64), batch_size=2))
    return {"state": state_of(module), "steps": recorder.steps}


def _gan(name: str, tmp: str) -> dict:
    """A fit of 2 epochs, and a resume of it from the first epoch's ``last.ckpt`` (each ZeRO stage: sharded, and a
    full file), as a user sees them."""
    out = {}
    for kind in ("sharded", "full") if name in ZERO else ("",):
        kwargs = {"state_dict_type": kind, "find_unused_parameters": True} if kind else {"find_unused_parameters": True}
        folder = Path(tmp) / f"{name}{kind}"

        def trainer(epochs: int, recorder: Recorder | None = None, folder=folder, kwargs=kwargs) -> L.Trainer:
            checkpoint = ModelCheckpoint(dirpath=folder, save_last=True)
            return quiet_trainer(
                make_strategy(name, **kwargs),
                max_epochs=epochs,
                limit_train_batches=4,
                enable_checkpointing=True,
                callbacks=[checkpoint, *([recorder] if recorder else [])],
            )

        L.seed_everything(SEED, verbose=False)
        module, recorder = GAN(), Recorder()
        trainer(2, recorder).fit(module, _loader())
        resumed = GAN()
        trainer(3).fit(resumed, _loader(), ckpt_path=str(folder / "last.ckpt"))
        out[kind] = {"state": state_of(module), "steps": recorder.steps, "resumed": state_of(resumed)}
    if name in ZERO and torch.distributed.get_rank() == 0:  # both kinds of the same step, read offline
        full = torch.load(Path(tmp) / f"{name}full" / "last.ckpt", weights_only=False)[OPTIMIZERS]
        converted = Path(tmp) / f"{name}converted"
        ckpt.convert(Path(tmp) / f"{name}sharded" / "last.ckpt", converted, stage=3 if name != "zero3_scratch" else 1)
        out["offline"] = {"full": full, "consolidated": ckpt.consolidate(converted)[OPTIMIZERS]}
    return out


def _zero_grad_fit(way: str, name: str, precision: str, grad_sync: str | None) -> dict:
    L.seed_everything(SEED, verbose=False)
    module, recorder = ZeroGradGAN(way), Recorder()
    kwargs = {"grad_sync": grad_sync} if grad_sync else {}
    strategy = make_strategy(name, find_unused_parameters=True, **kwargs)
    trainer = quiet_trainer(strategy, max_epochs=1, limit_train_batches=6, precision=precision, callbacks=[recorder])
    try:
        trainer.fit(module, _loader())
    except RuntimeError as error:
        return {"error": str(error)}
    return {"state": state_of(module), "steps": recorder.steps}


ZERO_GRAD_CELLS = [
    *[(way, name, "32-true", None) for way in ("docs", "accumulate", "discard") for name in ("ddp", *MANUAL)],
    *[(way, name, "32-true", GRAD_SYNC[name]) for way in ("docs", "accumulate", "discard") for name in ZERO],
    ("accumulate_bypassing", "zero1_scratch", "32-true", None),
    # bf16-true: the optimizers step fp32 masters under ddp_scratch too ([Note: zero_grad reaches the engine]).
    *[(way, name, "bf16-true", None) for way in ("accumulate", "discard") for name in ("ddp", *MANUAL)],
]


def _refusal(name: str) -> str:
    try:
        quiet_trainer(make_strategy(name), max_epochs=1, limit_train_batches=2).fit(GAN(), _loader())
    except ValueError as error:
        return str(error)
    return "trained"


def _all_fits(tmp: str) -> dict:
    torch.set_num_threads(1)
    out = {("gan", name): _gan(name, tmp) for name in ("ddp", *MANUAL)}
    out.update({("refused", name): _refusal(name) for name in OURS if name not in MANUAL})
    out.update({("boring", name, None): _boring_fit(name, None) for name in ("ddp", *MANUAL)})
    out.update({("boring", name, GRAD_SYNC[name]): _boring_fit(name, GRAD_SYNC[name]) for name in ZERO})
    out.update({cell: _zero_grad_fit(*cell) for cell in ZERO_GRAD_CELLS})
    return out


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    return run_workers(_all_fits, WORLD, str(tmp_path_factory.mktemp("gan")), timeout=600)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", MANUAL)
def test_two_optimizers_under_manual_optimization_train_and_resume_as_under_ddp(fits, name):
    """A GAN: two optimizers, ``toggle_optimizer``, ``self.clip_gradients`` of one, two LR schedulers, manual
    optimization. Each ZeRO stage shards each optimizer on its own: the weights, the losses and a resume from the
    first epoch's checkpoint (sharded and full) as under ``ddp``."""
    for rank in range(WORLD):
        peer = fits[rank]["gan", "ddp"][""]
        for kind, ours in fits[rank]["gan", name].items():
            if kind == "offline":
                continue
            assert max_diff(ours["state"], peer["state"]) <= TOLERANCE, (rank, kind)
            assert max_diff(ours["resumed"], peer["resumed"]) <= TOLERANCE, (rank, kind)
            assert len(ours["steps"]) == len(peer["steps"]) == 8
            for mine, theirs in zip(ours["steps"], peer["steps"]):
                assert math.isclose(mine["train_loss"], theirs["train_loss"], abs_tol=TOLERANCE), (mine, theirs)
    peer = fits[0]["gan", "ddp"][""]
    assert max_diff(peer["resumed"], peer["state"]) > 1e-3  # the third epoch moved the weights on


@pytest.mark.timeout(900)
@pytest.mark.parametrize("way", ["docs", "accumulate", "discard"])
@pytest.mark.parametrize("name", MANUAL)
def test_an_optimizers_zero_grad_drops_its_gradients_as_under_ddp(fits, name, way):
    """:class:`ZeroGradGAN`'s three ways, on every stage and its other gradient storage (``grad_sync``): the weights
    and the discriminator's loss of every step as under ``ddp``."""
    for rank in range(WORLD):
        peer = fits[rank][way, "ddp", "32-true", None]
        for grad_sync in (None, GRAD_SYNC.get(name)) if name in GRAD_SYNC else (None,):
            ours = fits[rank][way, name, "32-true", grad_sync]
            assert max_diff(ours["state"], peer["state"]) <= TOLERANCE, (rank, grad_sync)
            assert len(ours["steps"]) == len(peer["steps"]) > 0
            for mine, theirs in zip(ours["steps"], peer["steps"]):
                loss, peer_loss = mine["train_d_loss"], theirs["train_d_loss"]
                assert math.isclose(loss, peer_loss, abs_tol=TOLERANCE), (grad_sync, mine, theirs)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("way", ["accumulate", "discard"])
def test_zero_grad_reaches_the_fp32_masters_under_bf16_true(fits, way):
    """bf16-true: every strategy of ours steps fp32 masters (ddp_scratch in the module's buckets, ZeRO in its
    shards) and they agree exactly; Lightning's ``ddp`` steps the bf16 weights and stays close."""
    for rank in range(WORLD):
        peer, first = fits[rank][way, "ddp", "bf16-true", None], fits[rank][way, "ddp_scratch", "bf16-true", None]
        for name in MANUAL:
            ours = fits[rank][way, name, "bf16-true", None]
            assert max_diff(ours["state"], first["state"]) == 0, (rank, name)
            assert max_diff(ours["state"], peer["state"]) <= BF16_TOLERANCE, (rank, name)


@pytest.mark.timeout(900)
def test_a_backward_around_the_strategy_into_a_toggled_off_optimizers_gradients_is_refused(fits):
    """``loss.backward()`` instead of ``self.manual_backward(loss)`` while the discriminator is toggled off and holds
    the gradients of its window (stage 1): autograd added into them before any hook could refuse; the fit stops
    naming the parameter and the way out, which ``"accumulate"`` follows to train as ``ddp``."""
    error = fits[0]["accumulate_bypassing", "zero1_scratch", "32-true", None]["error"]
    assert "parameter 'discriminator." in error and "belongs to an optimizer toggled off" in error, error
    assert "self.manual_backward(loss)" in error
    assert "error" not in fits[0]["accumulate", "zero1_scratch", "32-true", None]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ZERO)
def test_lightning_zero_ckpt_converts_and_consolidates_both_optimizers(fits, name):
    """The GAN's sharded ``last.ckpt`` converted to the other layout (stage 3's per-parameter one, or stages 1/2's
    flat one) and consolidated holds both optimizers' states as the full ``last.ckpt`` of the same step does."""
    offline = fits[0]["gan", name]["offline"]
    assert len(offline["full"]) == len(offline["consolidated"]) == 2
    for full, consolidated in zip(offline["full"], offline["consolidated"]):
        assert [g["params"] for g in consolidated["param_groups"]] == [g["params"] for g in full["param_groups"]]
        assert consolidated["state"].keys() == full["state"].keys() and full["state"]
        for number, entry in full["state"].items():
            for key, value in entry.items():
                torch.testing.assert_close(consolidated["state"][number][key], value, atol=TOLERANCE, rtol=0)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [name for name in OURS if name not in MANUAL])
def test_the_robust_strategies_refuse_manual_optimization_by_name(fits, name):
    """Robust aggregation runs one rule per optimizer step of Lightning's own loop: a GAN is refused at setup."""
    assert fits[0]["refused", name] == f"{name} needs automatic optimization (automatic_optimization=True)"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", MANUAL)
def test_lightnings_manual_optimization_model_discarding_a_batch_trains_as_under_ddp(fits, name):
    """:class:`DiscardingBoring` (Lightning's ``ManualOptimBoringModel``) on every stage and its other ``grad_sync``:
    the weights and the loss of every step as under ``ddp``."""
    for rank in range(WORLD):
        peer = fits[rank]["boring", "ddp", None]
        for grad_sync in (None, GRAD_SYNC[name]) if name in GRAD_SYNC else (None,):
            ours = fits[rank]["boring", name, grad_sync]
            assert max_diff(ours["state"], peer["state"]) <= TOLERANCE, (rank, grad_sync)
            assert [step["train_loss"] for step in ours["steps"]] == pytest.approx(
                [step["train_loss"] for step in peer["steps"]], abs=TOLERANCE
            )
