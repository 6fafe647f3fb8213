"""Two optimizers under Fabric (``fabric.setup(model, g_opt, d_opt)``) against Fabric's own ``ddp``: each ZeRO stage
shards each optimizer on its own, an optimizer's ``zero_grad`` drops its gradients ([Note: zero_grad reaches the
engine] in ``lightning_zero/optim/sharding.py``), clipping takes the norm of one optimizer's parameters, and
``fabric.save``/``fabric.load`` carry both optimizers whatever the order of the state dict.

The loop is a GAN written as the PyTorch and Lightning examples write it, with the optimizers' ``zero_grad``: the
discriminator accumulates over two micro-batches (``fabric.no_backward_sync``) and is clipped; the generator's loss
backpropagates through the discriminator, whose gradients its next ``zero_grad`` drops.
"""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy
from torch import nn
from torch.nn import functional as F

import lightning_zero
from tests.fabric.test_fabric_checkpoint import _weights, straight_and_resumed
from tests.helpers.equivalence import max_diff
from tests.helpers.workers import run_workers

WORLD, STEPS, SAVED_AT, TOLERANCE = 2, 4, 2, 1e-5
CASES = [(f"zero{stage}_scratch", kind) for stage in (1, 2, 3) for kind in ("sharded", "full")]


class _GAN(nn.Module):
    """Both players called through ``forward``, one forward per backward, as torch DDP (Fabric's ``ddp``) needs."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, z: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
        """The discriminator's logits for ``real`` and the generated batch (detached), or with ``real=None`` for the
        generated batch alone (the generator's loss)."""
        if real is None:
            return self.discriminator(self.generator(z))
        return self.discriminator(torch.cat([real, self.generator(z).detach()]))


def _strategy(name: str, kind: str):
    """Each backward leaves one player without gradients: ``find_unused_parameters``, under ``ddp`` too."""
    if name == "ddp":
        return DDPStrategy(find_unused_parameters=True)
    return lightning_zero.fabric.ZeroStrategy(stage=int(name[4]), state_dict_type=kind, find_unused_parameters=True)


def _train(fabric: Fabric, steps: int, path: str | None = None, resume: str | None = None) -> dict:
    """A fresh GAN and its two optimizers set up; ``resume`` loaded; ``steps`` more steps; saved to ``path`` (the
    state lists the optimizers in the other order than ``fabric.setup``)."""
    torch.manual_seed(7)
    model = _GAN()
    g_opt = torch.optim.Adam(model.generator.parameters(), lr=0.01, betas=(0.5, 0.9))
    d_opt = torch.optim.SGD(model.discriminator.parameters(), lr=0.05, momentum=0.9)
    model, g_opt, d_opt = fabric.setup(model, g_opt, d_opt)
    state = {"model": model, "d_opt": d_opt, "g_opt": g_opt, "step": 0}
    if resume is not None:
        fabric.load(resume, state)
    for step in range(state["step"], state["step"] + steps):
        d_opt.zero_grad()
        for micro in range(2):
            g = torch.Generator().manual_seed(100 * step + 10 * micro + fabric.global_rank)
            real, z = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
            with fabric.no_backward_sync(model, enabled=micro == 0):
                labels = torch.cat([torch.ones(4, 1), torch.zeros(4, 1)])
                fabric.backward(F.binary_cross_entropy_with_logits(model(z, real), labels) / 2)
        fabric.clip_gradients(model, d_opt, max_norm=0.5)
        d_opt.step()
        g_opt.zero_grad()
        fabric.backward(F.binary_cross_entropy_with_logits(model(z), torch.ones(4, 1)))
        g_opt.step()
    state["step"] += steps
    if path is not None:
        fabric.save(path, state)
    return _weights(fabric, model)


def _every_strategy(directory: str) -> dict:
    out = {}
    for name, kind in [("ddp", ""), *CASES]:
        fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=_strategy(name, kind))
        fabric.launch()
        out[name, kind] = straight_and_resumed(_train, fabric, f"{directory}/{name}-{kind}.ckpt", STEPS, SAVED_AT)
    for name in ("ddp_scratch", "zero2_scratch"):  # the players set up one after the other, as Fabric's DCGAN does
        fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=name)
        fabric.launch()
        players = _GAN()
        generator, _ = fabric.setup(players.generator, torch.optim.SGD(players.generator.parameters(), lr=0.1))
        discriminator, _ = fabric.setup(players.discriminator, torch.optim.SGD(players.discriminator.parameters()))
        discriminator(torch.randn(4, 8))  # the model set up last runs
        try:
            generator(torch.randn(4, 4))
        except RuntimeError as error:
            out["two setups", name] = str(error)
    for stage in (2, 3):  # stage 2 flattens the optimizer's groups, stage 3 rebuilds them over its shards
        fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=_strategy(f"zero{stage}_scratch", "sharded"))
        fabric.launch()
        model = fabric.setup_module(_GAN())
        try:
            fabric.setup_optimizers(torch.optim.SGD(model.generator.parameters(), lr=0.1))
            fabric.setup_optimizers(torch.optim.SGD(model.discriminator.parameters(), lr=0.1))
        except ValueError as error:
            out["one at a time", stage] = str(error)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_workers(_every_strategy, WORLD, str(tmp_path_factory.mktemp("gan")), timeout=400)


@pytest.mark.timeout(450)
@pytest.mark.parametrize(("name", "kind"), CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_a_gan_trains_saves_and_resumes_as_under_fabric_ddp(runs, name, kind):
    for rank_run in runs:
        peer, run = rank_run["ddp", ""], rank_run[name, kind]
        assert max_diff(run["straight"], peer["straight"]) <= TOLERANCE
        assert all(torch.equal(run["resumed"][k], v) for k, v in run["straight"].items())
        assert max_diff(peer["resumed"], peer["straight"]) <= TOLERANCE


@pytest.mark.timeout(450)
def test_optimizers_set_up_one_at_a_time_are_refused_with_the_way_out(runs):
    """``fabric.setup_optimizers(g_opt)`` then ``(d_opt)``: refused at the first, which leaves the discriminator in
    no optimizer, naming the parameters and the way out (the test above follows it)."""
    for stage in (2, 3):
        error = runs[0]["one at a time", stage]
        assert "trainable parameters ['discriminator.0.weight'" in error, error
        assert "fabric.setup(model, optimizer_1, optimizer_2)" in error


@pytest.mark.timeout(450)
@pytest.mark.parametrize("name", ["ddp_scratch", "zero2_scratch"])
def test_a_model_whose_engine_a_later_setup_replaced_refuses_to_run(runs, name):
    """Two ``fabric.setup`` calls, one per player: the first model would train without averaged gradients, so its
    forward stops, naming both models and the way out (one module, ``fabric.setup(model, g_opt, d_opt)``: above)."""
    error = runs[0]["two setups", name]
    assert error.startswith(f"{name} trains one model at a time: Sequential was set up before Sequential"), error
    assert "fabric.setup(model, g_opt, d_opt)" in error
