"""The parameter lifecycle against Lightning's ``ddp``: modules whose parameters are frozen beside trainable ones, used
on some ranks only, used several times, recomputed, differentiated twice or read outside their module's forward.

Each family is one small LightningModule fitted under Lightning's ``ddp`` and under every strategy of ours (and
three ZeRO-3 layouts: every ``nn.Linear`` its own unit, units kept gathered until backward, hybrid sharding) in one
pair of gloo workers, with the same seed; a user's view of the result (``state_dict()`` on every rank, logged losses,
global step) must match within 1e-5. ZeRO-3 decides when a unit's backward is complete from the autograd graph
([Note: unit lifecycle] in ``lightning_zero/zero/stage3/backward.py``); these are the cases a rule based on counting
trainable gradients got wrong (a frozen weight needed after its adapters' gradients, ``torch.autograd.grad`` taken
for the backward pass, a hang when an expert is unused on one rank).
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.equivalence import OURS, Recorder, make_strategy, max_diff, state_of
from tests.helpers.parity import quiet_trainer
from tests.helpers.workers import run_workers

TOLERANCE = 1e-5
SEED = 7
WORLD = 2
WIDTH = 8


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(1234)
    return DataLoader(TensorDataset(torch.randn(48, WIDTH, generator=g), torch.randn(48, 1, generator=g)), batch_size=4)


class _Regression(L.LightningModule):
    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)


class ExpertBlock(nn.Module):
    """An always-used MLP and an expert that only rank 0 routes to."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.expert = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, route: bool) -> torch.Tensor:
        x = self.mlp(x)
        return x + self.expert(x) if route else x


class Experts(_Regression):
    """A submodule inside a unit used on some ranks only (``find_unused_parameters=True``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ExpertBlock() for _ in range(3)])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x, route=self.global_rank == 0)
        return self.head(x)


class GatedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.gate = nn.Linear(WIDTH, WIDTH), nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor, gated: bool) -> torch.Tensor:
        x = torch.tanh(self.fc(x))
        return x * self.gate if gated else x


class OneTensorUnused(_Regression):
    """One tensor of a unit used on some ranks only (``find_unused_parameters=True``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([GatedBlock(), GatedBlock()])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x, gated=self.global_rank == 1)
        return self.head(x)


class LoRABlock(nn.Module):
    """A frozen base weight beside trainable low-rank adapters: ``base(x) + B(A(x))``."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.A, self.B = nn.Linear(WIDTH, 2, bias=False), nn.Linear(2, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + self.B(self.A(x)))


class LoRA(_Regression):
    """Parameter-efficient fine-tuning: the optimizer gets the trainable parameters (or, ``all_params``, all)."""

    def __init__(self, all_params: bool = False) -> None:
        super().__init__()
        self.all_params = all_params
        self.blocks = nn.ModuleList([LoRABlock() for _ in range(3)])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def configure_optimizers(self):
        params = self.parameters() if self.all_params else [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


class Shared(_Regression):
    """The same block run twice per forward (weight sharing within a step)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        x = self.blocks[0](x)
        return self.head(self.blocks[1](self.blocks[1](x)))


class Checkpointed(Shared):
    """A block under the user's own ``torch.utils.checkpoint``, reentrant or not."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x):
        x = self.blocks[0](x)
        x = torch.utils.checkpoint.checkpoint(self.blocks[1], x, use_reentrant=self.reentrant)
        return self.head(x)


class MAML(_Regression):
    """A MAML-style inner step: ``torch.autograd.grad(..., create_graph=True)`` and ``torch.func.functional_call``
    inside ``training_step``, fast weights computed from the parameters outside any forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        params = dict(self.net.named_parameters())
        inner = F.mse_loss(torch.func.functional_call(self.net, params, (x[:2],)), y[:2])
        grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
        fast = {name: p - 0.1 * g for (name, p), g in zip(params.items(), grads)}
        loss = F.mse_loss(torch.func.functional_call(self.net, fast, (x[2:],)), y[2:])
        self.log("train_loss", loss)
        return loss


class GradientPenalty(_Regression):
    """WGAN-GP's penalty: the gradient with respect to the input (``create_graph=True``) in the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        probe = x.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(self.net(probe).sum(), probe, create_graph=True)
        loss = F.mse_loss(self.net(x), y) + 0.1 * ((grad.norm(dim=1) - 1) ** 2).mean()
        self.log("train_loss", loss)
        return loss


class L2Penalty(_Regression):
    """An L2 penalty over ``self.parameters()`` after the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self.net(batch[0]), batch[1]) + 0.01 * sum(p.pow(2).sum() for p in self.parameters())
        self.log("train_loss", loss)
        return loss


class Encoder(_Regression):
    """``nn.TransformerEncoderLayer``: its ``MultiheadAttention`` reads ``out_proj.weight`` without calling
    ``out_proj`` (a unit of its own when every ``nn.Linear`` is one)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(WIDTH, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        return self.head(self.encoder(x.view(x.shape[0], 2, WIDTH // 2).repeat(1, 1, 2)).mean(1))


class Embedded(_Regression):
    """An embedding looked up from the inputs: with ``max_norm`` it renormalises the looked-up rows in place in its
    forward (each rank its own); ``normalize``: the advice, the looked-up vectors normalised instead."""

    def __init__(self, max_norm: float | None = 1.0, normalize: bool = False) -> None:
        super().__init__()
        self.normalize = normalize
        self.embedding = nn.Embedding(16, WIDTH, max_norm=max_norm)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        vectors = self.embedding((x.abs() * 4).long().clamp(max=15)).mean(1)
        return self.head(F.normalize(vectors, dim=-1) if self.normalize else vectors)


class RenormsInTheStep(Shared):
    """The user's own renorm of a weight in ``training_step``, in place."""

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            self.head.weight.div_(self.head.weight.norm().clamp(min=1.0))
        return super().training_step(batch, batch_idx)


class ClampsAfterEachStep(Shared):
    """WGAN-style weight clipping in ``on_train_batch_end``, in place on the parameters."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with torch.no_grad():
            for p in self.parameters():
                p.clamp_(-0.3, 0.3)


class CompiledInPlace(_Regression):
    """``Module.compile()`` in ``configure_model`` (it compiles ``_call_impl``, forward hooks included): ``"units"``
    each block (a ZeRO-3 unit), ``"around"`` the ``nn.Sequential`` that holds the blocks, ``"inside"`` a layer inside
    each block."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(WIDTH, 1)

    def configure_model(self) -> None:
        targets = {"units": list(self.blocks), "around": [self.blocks], "inside": [b[0] for b in self.blocks]}
        for module in targets[self.where]:
            module.compile()

    def forward(self, x):
        return self.head(self.blocks(x))


FAMILIES = {
    # name: (module factory, strategy kwargs, Trainer kwargs)
    "experts": (Experts, {"find_unused_parameters": True}, {}),
    "one_tensor_unused": (OneTensorUnused, {"find_unused_parameters": True}, {"accumulate_grad_batches": 2}),
    "lora": (LoRA, {}, {"accumulate_grad_batches": 2}),
    "lora_all_params": (lambda: LoRA(all_params=True), {}, {}),
    "shared": (Shared, {}, {}),
    "checkpoint_reentrant": (lambda: Checkpointed(reentrant=True), {}, {}),
    "checkpoint_non_reentrant": (lambda: Checkpointed(reentrant=False), {}, {"accumulate_grad_batches": 2}),
    "maml": (MAML, {}, {}),
    "gradient_penalty": (GradientPenalty, {}, {"accumulate_grad_batches": 2}),
    "l2_penalty": (L2Penalty, {}, {}),
    "encoder": (Encoder, {}, {}),
    "embedding_normalized": (lambda: Embedded(max_norm=None, normalize=True), {}, {}),
    "compiled_units": (lambda: CompiledInPlace("units"), {}, {}),
    "compiled_around_units": (lambda: CompiledInPlace("around"), {}, {}),
    "compiled_inside_units": (lambda: CompiledInPlace("inside"), {}, {}),
}

WRITES_IN_PLACE = {
    "embedding_max_norm": (Embedded, {}, {}),
    "renorm_in_the_step": (RenormsInTheStep, {}, {}),
    "clamp_after_each_step": (ClampsAfterEachStep, {}, {}),
}
"""Parameters written in place outside the optimizer: ``ddp`` keeps each rank's writes, ZeRO cannot and refuses."""

ZERO3_LAYOUTS = {
    "zero3_linear_units": {"auto_wrap_policy": {nn.Linear}},
    "zero3_keep_gathered": {"reshard_after_forward": False},
    "zero3_hybrid": {"shard_size": 1},
}
"""ZeRO-3 besides its default units: every ``nn.Linear`` a unit (units nested, parameters read by a parent), units
kept gathered from forward to backward, hybrid sharding (shards of one rank, replicated across both)."""

NAMES = (*OURS, *ZERO3_LAYOUTS)


def _strategy(name: str, **kwargs):
    layouts = {**ZERO3_LAYOUTS, "zero3_block_units": {"auto_wrap_policy": {ExpertBlock}}}
    if name in layouts:
        return make_strategy("zero3_scratch", **layouts[name], **kwargs)
    return make_strategy(name, **kwargs)


def _fit(family: str, name: str) -> dict:
    make_module, strategy_kwargs, trainer_kwargs = {**FAMILIES, **WRITES_IN_PLACE}[family]
    L.seed_everything(SEED, verbose=False)
    module, recorder = make_module(), Recorder()
    trainer = quiet_trainer(
        _strategy(name, **strategy_kwargs), max_epochs=1, limit_train_batches=5, callbacks=[recorder], **trainer_kwargs
    )
    try:
        trainer.fit(module, _loader())
    except (RuntimeError, ValueError) as error:
        return {"error": "\n".join([str(error), *getattr(error, "__notes__", [])])}
    return {"state": state_of(module), "steps": recorder.steps, "global_step": trainer.global_step}


REFUSED = {("experts", "zero3_linear_units")}
"""An expert that is a unit of its own and runs on rank 0 only: rank 1 never gathers it, so ZeRO-3 refuses (every
rank must run the same units); the advice is to make it part of a unit every rank runs."""


def _all_fits() -> dict:
    torch.set_num_threads(1)
    out = {(family, name): _fit(family, name) for family in FAMILIES for name in ("ddp", *NAMES)}
    out["experts", "zero3_block_units"] = _fit("experts", "zero3_block_units")  # the refusal's advice, followed
    for family in WRITES_IN_PLACE:
        out.update({(family, name): _fit(family, name) for name in ("ddp", *OURS)})
    return out


@pytest.fixture(scope="module")
def fits():
    return run_workers(_all_fits, WORLD, timeout=600)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("family", "name"), [(f, n) for f in FAMILIES for n in NAMES if (f, n) not in REFUSED])
def test_trains_as_lightning_ddp(fits, family, name):
    """Weights on every rank, the loss logged at every step and the global step, as under ``ddp``."""
    _assert_as_ddp(fits, family, name)


def _assert_as_ddp(fits: list[dict], family: str, name: str) -> None:
    for rank in range(WORLD):
        ours, peer = fits[rank][family, name], fits[rank][family, "ddp"]
        assert "error" not in ours, ours.get("error")
        assert "error" not in peer, peer["error"]
        assert max_diff(ours["state"], peer["state"]) <= TOLERANCE, rank
        assert ours["global_step"] == peer["global_step"]
        assert len(ours["steps"]) == len(peer["steps"])
        for mine, theirs in zip(ours["steps"], peer["steps"]):
            assert math.isclose(mine["train_loss"], theirs["train_loss"], abs_tol=TOLERANCE), (mine, theirs)


@pytest.mark.timeout(900)
def test_the_families_discriminate(fits):
    """What each case claims happens under ``ddp``: the expert and the gate train on the ranks that use them and
    average to different weights than their initial ones, the frozen base stays as built, the steps are real."""
    built = {}
    for family, make_module in (("experts", Experts), ("lora", LoRA)):
        L.seed_everything(SEED, verbose=False)
        built[family] = make_module().state_dict()
    experts, lora = fits[0]["experts", "ddp"]["state"], fits[0]["lora", "ddp"]["state"]
    assert (experts["blocks.0.expert.weight"] - built["experts"]["blocks.0.expert.weight"]).abs().max() > 1e-3
    assert torch.equal(lora["blocks.0.base.weight"], built["lora"]["blocks.0.base.weight"])
    assert (lora["blocks.0.A.weight"] - built["lora"]["blocks.0.A.weight"]).abs().max() > 1e-3
    for family in FAMILIES:
        steps = fits[0][family, "ddp"]["steps"]
        assert len(steps) == 5 and all(math.isfinite(s["train_loss"]) for s in steps), family


@pytest.mark.timeout(900)
def test_a_unit_that_some_ranks_skip_is_refused_and_the_advice_works(fits):
    """Every ``nn.Linear`` a unit: rank 1 never runs the expert units, and the first gather that differs stops both
    ranks, naming the units and the way out; following it (the block that holds the expert as the unit) trains as
    ``ddp``."""
    for rank in range(WORLD):
        error = fits[rank]["experts", "zero3_linear_units"]["error"]
        assert "gathers unit 'blocks.0.expert'" in error and "auto_wrap_policy" in error, error
    _assert_as_ddp(fits, "experts", "zero3_block_units")


ZERO = [name for name in OURS if "zero" in name]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", list(WRITES_IN_PLACE))
@pytest.mark.parametrize("name", OURS)
def test_parameters_written_in_place_are_followed_as_ddp_or_refused_by_name(fits, family, name):
    """``ddp`` keeps each rank's in-place writes (an embedding's ``max_norm`` renorm, a renorm in ``training_step``, a
    clamp in ``on_train_batch_end``); the strategies that keep a copy per rank do too, the ZeRO stages refuse naming
    the module or parameter and the way out (``ddp_scratch``, followed in the other cases, or ``F.normalize``:
    ``embedding_normalized`` above)."""
    if name not in ZERO:
        _assert_as_ddp(fits, family, name)
        return
    for rank in range(WORLD):
        error = fits[rank][family, name]["error"]
        if family == "embedding_max_norm":
            assert "cannot train ['embedding (Embedding, max_norm=1.0)']" in error, error
            assert "F.normalize" in error
        elif family == "clamp_after_each_step" and name == "zero3_scratch":  # a placeholder: torch refuses the write
            assert "between training steps a module parameter is a placeholder" in error, error
        else:
            where = "during training_step" if family == "renorm_in_the_step" else "between two training steps"
            assert "'head.weight'" in error and where in error and "head (Linear)" in error, error
        assert "ddp_scratch" in error
    if family == "embedding_max_norm":  # the rows really are renormalised, differently on each rank
        states = [fits[rank][family, "ddp"]["state"]["embedding.weight"] for rank in range(WORLD)]
        assert (states[0] - states[1]).abs().max() > 1e-3
