"""The deterministic parity model, its data, and the single-process PyTorch reference it must match.

The reference replays exactly what Lightning does with N data-parallel ranks, but in one process with plain PyTorch:
- the training loader of every rank is a shuffling ``DistributedSampler(num_replicas=N, rank=r, seed=seed)`` with
  ``set_epoch(epoch)`` (Lightning injects it even though the user's loader does not shuffle);
- step k's global batch is the union of every rank's k-th local batch, and the loss is the mean of the ranks' local
  mean losses (what averaging gradients computes);
- each micro-batch loss is divided by ``accumulate_grad_batches``, also in a short last window of an epoch, and the
  optimizer steps at the end of each window and at the end of the epoch;
- norm clipping, then ``AdamW.step``, then the per-step LR scheduler.

Two models: ``"mlp"`` (the default; LayerNorm and biases in a no-decay group) and ``"gpt"``, a two-block causal
transformer whose token embedding is tied to its LM head. ``ParityModule(build_in_configure_model=True)`` builds the
net in ``configure_model`` (on the meta device under ZeRO-3); ``make_net`` seeds itself, so every build is identical.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


@dataclass(frozen=True)
class ParityConfig:
    world_size: int = 2
    accumulate_grad_batches: int = 1
    batch_size: int = 4  # per rank
    batches_per_rank: int = 8  # per epoch; 8 % 3 != 0 gives a short last accumulation window
    max_epochs: int = 2
    gradient_clip_val: float | None = 0.05  # small enough to clip on every step
    lr: float = 2e-2
    seed: int = 7
    optimizer: str = "adamw"  # "sgd" (momentum, no clipping) is sensitive to the gradient's scale; AdamW is not
    model: str = "mlp"  # or "gpt", "mlp_frozen", "two_layer"

    @property
    def dataset_size(self) -> int:
        # One sample short of a full multiple, so the sampler pads (repeats) indices whenever world_size > 1.
        return self.world_size * self.batch_size * self.batches_per_rank - 1

    @property
    def optimizer_steps(self) -> int:
        windows_per_epoch = -(-self.batches_per_rank // self.accumulate_grad_batches)
        return windows_per_epoch * self.max_epochs


VOCAB, CONTEXT, WIDTH = 13, 8, 16


def make_dataset(config: ParityConfig) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    if config.model == "gpt":
        tokens = torch.randint(0, VOCAB, (config.dataset_size, CONTEXT + 1), generator=g)
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])
    x = torch.randn(config.dataset_size, 6, generator=g)
    y = torch.randn(config.dataset_size, 3, generator=g)
    return TensorDataset(x, y)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # No qkv bias: the key bias has a zero gradient in exact arithmetic (softmax ignores it), and AdamW would
        # turn its rounding noise into full-size steps that differ between any two summation orders.
        self.ln_1, self.qkv = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.ln_2, self.fc = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, 2, WIDTH // 2).transpose(1, 2) for z in self.qkv(self.ln_1(x)).chunk(3, dim=-1))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))
        return x + self.fc(torch.tanh(self.ln_2(x)))


class TinyGPT(nn.Module):
    """Two blocks, token embedding tied to the LM head (a weight shared by the first and the last module)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln_f, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class TwoLayer(nn.Module):
    """No container: under ZeRO-3 every parameter is in the root unit."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def make_net(model: str = "mlp") -> nn.Module:
    """``"mlp"``, ``"gpt"``, ``"two_layer"``, or ``"mlp_frozen"``: the MLP with its middle Linear frozen."""
    torch.manual_seed(0)
    if model == "gpt":
        return TinyGPT()
    if model == "two_layer":
        return TwoLayer()
    net = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    if model == "mlp_frozen":
        net[3].requires_grad_(False)
    return net


def make_optimizer(
    net: nn.Module, lr: float, kind: str = "adamw"
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """Two param groups (decay / no decay for biases and norms), AdamW or SGD, and an LR decaying every step."""
    decay = [p for p in net.parameters() if p.ndim >= 2]
    no_decay = [p for p in net.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=lr) if kind == "adamw" else torch.optim.SGD(groups, lr=lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.3 * step))
    return optimizer, scheduler


def loss_fn(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = net(x)
    if out.ndim == 3:  # token logits
        return F.cross_entropy(out.flatten(0, 1), y.flatten())
    return F.mse_loss(out, y)


class ParityModule(L.LightningModule):
    def __init__(
        self, lr: float = 2e-2, optimizer: str = "adamw", model: str = "mlp", build_in_configure_model: bool = False
    ) -> None:
        super().__init__()
        self.lr = lr
        self.optimizer_kind = optimizer
        self.model_kind = model
        self.net = None if build_in_configure_model else make_net(model)

    def configure_model(self) -> None:
        if self.net is None:
            self.net = make_net(self.model_kind)

    def training_step(self, batch, batch_idx):
        return loss_fn(self.net, *batch)

    def configure_optimizers(self):
        optimizer, scheduler = make_optimizer(self.net, self.lr, self.optimizer_kind)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def quiet_trainer(strategy, devices: int = 2, **kwargs) -> L.Trainer:
    """A CPU ``Trainer`` without logger, checkpoints, progress bar, summary or sanity check, unless ``kwargs`` say."""
    defaults = dict(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)


def make_trainer(config: ParityConfig, strategy, **kwargs) -> L.Trainer:
    defaults = dict(
        devices=config.world_size,
        max_epochs=config.max_epochs,
        accumulate_grad_batches=config.accumulate_grad_batches,
        gradient_clip_val=config.gradient_clip_val,
        gradient_clip_algorithm="norm",
    )
    defaults.update(kwargs)
    return quiet_trainer(strategy, **defaults)


def train_loader(config: ParityConfig) -> DataLoader:
    return DataLoader(make_dataset(config), batch_size=config.batch_size, shuffle=False)


def fit_lightning(config: ParityConfig, strategy, **trainer_kwargs) -> dict[str, torch.Tensor]:
    """Fit ParityModule under ``strategy`` and return the final parameters (on CPU)."""
    L.seed_everything(config.seed, verbose=False)
    module = ParityModule(config.lr, config.optimizer)
    trainer = make_trainer(config, strategy, **trainer_kwargs)
    trainer.fit(module, train_loader(config))
    assert trainer.global_step == config.optimizer_steps, (trainer.global_step, config.optimizer_steps)
    engine = getattr(trainer.strategy, "engine", None)  # ZeRO-3 keeps the model sharded: gather it (collective)
    with engine.summon_full_params() if hasattr(engine, "summon_full_params") else nullcontext():
        return {k: v.detach().cpu().clone() for k, v in module.net.state_dict().items()}


def reference_params(config: ParityConfig, losses: list[float] | None = None) -> dict[str, torch.Tensor]:
    """Single-process plain PyTorch run on the same global batches (see the module docstring); each batch's loss is
    appended to ``losses`` when given."""
    dataset = make_dataset(config)
    net = make_net(config.model)
    optimizer, scheduler = make_optimizer(net, config.lr, config.optimizer)
    g = config.accumulate_grad_batches
    for epoch in range(config.max_epochs):
        per_rank = []
        for r in range(config.world_size):
            sampler = DistributedSampler(
                dataset, num_replicas=config.world_size, rank=r, shuffle=True, seed=config.seed
            )
            sampler.set_epoch(epoch)
            per_rank.append(list(sampler))
        n_batches = -(-len(per_rank[0]) // config.batch_size)
        optimizer.zero_grad(set_to_none=True)
        for k in range(n_batches):
            rank_losses = []
            for indices in per_rank:
                x, y = dataset[indices[k * config.batch_size : (k + 1) * config.batch_size]]
                rank_losses.append(loss_fn(net, x, y))
            loss = torch.stack(rank_losses).mean()
            if losses is not None:
                losses.append(loss.item())
            (loss / g).backward()
            if (k + 1) % g == 0 or k + 1 == n_batches:
                if config.gradient_clip_val is not None:
                    torch.nn.utils.clip_grad_norm_(net.parameters(), config.gradient_clip_val)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_optimizer_states_equal(a: dict, b: dict) -> None:
    """Two optimizer state dicts (unsharded format) hold the same hyper-parameters and bit-identical tensors."""
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for index, state in a["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b["state"][index][key]), (index, key)
