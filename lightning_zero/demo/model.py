"""A small character-level GPT as a LightningModule, built in ``configure_model()`` (meta-device safe).

Under Lightning's ``ModelParallelStrategy`` (``strategy=fsdp2``) ``configure_model()`` also applies torch's FSDP2
``fully_shard`` to every transformer block and then to the whole network, on the device mesh's ``data_parallel``
dimension: the CPU-capable peer of ``zero3_scratch``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from types import MappingProxyType
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torchmetrics.text import Perplexity

from lightning_zero.tensor_parallel import GPT_PLAN, gather_from_parallel_region, vocab_parallel_cross_entropy

try:
    from torch.distributed.fsdp import FSDPModule, fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import FSDPModule, fully_shard


def shard_fsdp2(root: nn.Module, units: Iterable[nn.Module], device_mesh: Any) -> None:
    """FSDP2 over the mesh's ``data_parallel`` dimension: ``fully_shard`` each of ``units``, then ``root`` (the rest
    of the parameters); nothing if ``device_mesh`` is ``None`` (not ``ModelParallelStrategy``) or ``root`` is
    sharded already (a later fit of the same module)."""
    if device_mesh is None or isinstance(root, FSDPModule):
        return
    for unit in units:
        fully_shard(unit, mesh=device_mesh["data_parallel"])
    fully_shard(root, mesh=device_mesh["data_parallel"])


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP, standard layers only."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln_1, self.qkv, self.proj = nn.LayerNorm(n_embd), nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Widths from the tensors, not n_embd: under tensor parallelism qkv yields this rank's n_head heads only.
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in self.qkv(self.ln_1(x)).chunk(3, -1))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.ln_2(x))


class Embeddings(nn.Module):
    """The token and position embeddings, summed: the network's first layer as a pipeline sees it."""

    def __init__(self, wte: nn.Module, wpe: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


class LMHead(nn.Module):
    """The final LayerNorm and the head: the network's last layer as a pipeline sees it."""

    def __init__(self, ln_f: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.head = ln_f, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


class CharGPT(nn.Module):
    """Token and position embeddings, ``n_layer`` blocks in an ``nn.ModuleList`` (ZeRO-3's default units), a head.

    The forward runs :attr:`layers`, the same modules as one ``nn.Sequential`` (what ``pipeline_scratch`` cuts into
    stages); the state dict keeps the names above.
    """

    def __init__(
        self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList([Block(n_embd, n_head, dropout) for _ in range(n_layer)])
        self.ln_f, self.head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab_size, bias=False)

    @property
    def layers(self) -> nn.Sequential:
        """``Embeddings``, the blocks, ``LMHead``: this network's own modules as an ``nn.Sequential``.

        A view kept outside the module tree (no second name in the state dict), rebuilt when one of its modules was
        replaced since (tensor parallelism swaps the embedding and the head for their parallel versions)."""
        parts = [self.wte, self.wpe, *self.blocks, self.ln_f, self.head]
        built = self.__dict__.get("_layers_parts")
        if built is None or len(built) != len(parts) or any(a is not b for a, b in zip(built, parts)):
            view = nn.Sequential(Embeddings(self.wte, self.wpe), *self.blocks, LMHead(self.ln_f, self.head))
            self.__dict__["_layers"], self.__dict__["_layers_parts"] = view, parts  # not registered: a view
        return self.__dict__["_layers"]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.layers(idx)


class CharGPTModule(L.LightningModule):
    """Trains :class:`CharGPT`; logs ``train/loss``, ``val/loss`` and ``val/ppl`` (torchmetrics ``Perplexity``).

    Args:
        vocab_size: number of distinct tokens (the data module's ``vocab_size``).
        block_size: context length.
        n_layer, n_head, n_embd, dropout: the network's size (``n_embd`` divisible by ``n_head``).
        optimizer: a partial optimizer (``params -> Optimizer``), e.g. Hydra's ``_partial_: true``; default AdamW.
        warmup_steps: linear learning-rate warm-up, then cosine decay to ``min_lr_ratio`` over the planned steps.
        min_lr_ratio: final learning rate as a fraction of the initial one.
        vocab_multiple: build the embedding and head for ``vocab_size`` rounded up to a multiple of this (Megatron's
            ``make-vocab-size-divisible-by``: tensor parallelism splits the vocabulary evenly); the extra ids never
            occur, and the softmax learns to give them nothing.

    Under ``tensor_parallel_scratch`` with a vocabulary-sharded head (``GPT_PLAN``) the losses come from the logits'
    slices (``vocab_parallel_cross_entropy`` over ``tensor_parallel_group``) and ``val/ppl`` from the gathered
    logits: the logged numbers are the unparallelized model's.

    ``ppl_history`` holds ``(global_step, val_ppl)`` for every validation pass, the sanity check included (step 0,
    the untrained model), so a run can report its first and last perplexity. ``val_history`` is the same list under
    the name every demo module shares (the history of its optimized metric, ``val/ppl`` here).
    """

    history_metric = "val/ppl"

    def __init__(
        self,
        vocab_size: int,
        block_size: int = 64,
        n_layer: int = 3,
        n_head: int = 4,
        n_embd: int = 96,
        dropout: float = 0.0,
        optimizer: Callable[..., torch.optim.Optimizer] | None = None,
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
        vocab_multiple: int = 1,
    ) -> None:
        super().__init__()
        if isinstance(vocab_multiple, bool) or not isinstance(vocab_multiple, int) or vocab_multiple < 1:
            raise ValueError(f"vocab_multiple={vocab_multiple!r} is invalid: expected an integer >= 1")
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is invalid: expected a multiple of n_head={n_head}")
        if warmup_steps < 0 or not 0 <= min_lr_ratio <= 1:
            raise ValueError(f"warmup_steps={warmup_steps}, min_lr_ratio={min_lr_ratio}: expected >= 0 and in [0, 1]")
        self.save_hyperparameters(ignore=["optimizer"])
        self.optimizer_factory = optimizer
        self.net: CharGPT | None = None
        self.val_ppl = Perplexity()
        self.ppl_history: list[tuple[int, float]] = []

    @property
    def padded_vocab_size(self) -> int:
        """``vocab_size`` rounded up to a multiple of ``vocab_multiple``: the network's embedding and head size."""
        multiple = self.hparams.vocab_multiple
        return -(-self.hparams.vocab_size // multiple) * multiple

    @property
    def val_history(self) -> list[tuple[int, float]]:
        """``(global_step, val/ppl)`` per validation pass: the history of this module's optimized metric."""
        return self.ppl_history

    def configure_model(self) -> None:
        """Build the network (first call only); under ``ModelParallelStrategy`` shard it with FSDP2."""
        if self.net is None:
            h = self.hparams
            self.net = CharGPT(self.padded_vocab_size, h.block_size, h.n_layer, h.n_head, h.n_embd, h.dropout)
        shard_fsdp2(self.net, self.net.blocks, self.device_mesh)  # device_mesh: only under ModelParallelStrategy

    @property
    def pipeline_layers(self) -> nn.Sequential | None:
        """What ``pipeline_scratch`` cuts into stages: the network's :attr:`CharGPT.layers`."""
        return self.net.layers if self.net is not None else None

    tensor_parallel_plan = MappingProxyType({f"net.{key}": style for key, style in GPT_PLAN.items()})
    """What ``tensor_parallel_scratch`` applies: Megatron's plan for the network (``GPT_PLAN``)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        assert self.net is not None, "configure_model() builds the network"
        return self.net(idx)

    def _vocab_group(self, logits: torch.Tensor) -> Any:
        """The tensor-parallel group when ``logits`` are this rank's slice of the vocabulary (a vocabulary-sharded
        head under ``tensor_parallel_scratch``, which sets ``tensor_parallel_group``), else ``None``."""
        group = getattr(self, "tensor_parallel_group", None)
        return group if group is not None and logits.shape[-1] != self.padded_vocab_size else None

    def _loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        group = self._vocab_group(logits)
        if group is not None:  # the loss from the slices, without gathering the logits
            return vocab_parallel_cross_entropy(logits.flatten(0, 1), y.flatten(), group)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self._loss(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val/loss", self._loss(logits, y), sync_dist=True)
        group = self._vocab_group(logits)
        # Perplexity needs every id's logit: the slices gathered (validation only, no gradient).
        self.val_ppl.update((logits if group is None else gather_from_parallel_region(logits, group)).float(), y)

    def on_validation_epoch_end(self) -> None:
        # Collective: every rank calls it. Under tensor parallelism each replica's ranks count the same tokens, which
        # scales the summed log-probabilities and the token count alike: the ratio, and the perplexity, are unchanged.
        ppl = self.val_ppl.compute()
        self.val_ppl.reset()
        self.log("val/ppl", ppl, prog_bar=True, sync_dist=True)  # equal on every rank already
        self.ppl_history.append((self.global_step, float(ppl)))

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
        factory = self.optimizer_factory or (lambda params: torch.optim.AdamW(params, lr=3e-3))
        optimizer = factory(groups)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup, floor = self.hparams.warmup_steps, self.hparams.min_lr_ratio

        def lr_lambda(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
