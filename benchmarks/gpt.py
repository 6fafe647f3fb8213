"""A small GPT-2-style decoder and its LightningModule: the shared workload of the lightning_zero benchmarks.

Runbook::

    from benchmarks.gpt import GPTConfig, GPTLightningModule, random_token_dataset

    config = GPTConfig()                        # ~27.4M trainable parameters
    module = GPTLightningModule(config)         # AdamW(lr=3e-4, fused=True) for every strategy
    data = random_token_dataset(num_samples=64, block_size=config.block_size, vocab_size=config.vocab_size)
    trainer.fit(module, DataLoader(data, batch_size=2))  # the Trainer calls module.configure_model()

    python benchmarks/gpt.py                    # prints the parameter count of each preset

Presets: ``PRESETS["gpt25m"]`` (the default config: vocab 8192, 6 layers, width 512, 8 heads, context 256),
``PRESETS["small"]`` (4.2M parameters: bf16 on CPUs without bf16 instructions) and ``PRESETS["tiny"]`` for smoke
runs. The model is a plain ``nn.Module`` (no buffers, no dropout by default) so every strategy sees exactly the same
parameters; attention uses ``F.scaled_dot_product_attention(is_causal=True)`` and
needs no mask buffer.

``GPTLightningModule`` builds its ``GPT`` in ``configure_model()`` (unless already built), the hook where sharded
strategies take over: under Lightning's ``ModelParallelStrategy`` it then applies FSDP2 ``fully_shard`` to every
``Block`` and to the root model, on the ``"data_parallel"`` dimension of the strategy's device mesh, with FSDP2's
``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` when the Trainer's ``precision`` is
``"bf16-mixed"`` (fp32 otherwise). The weights are those of a ``GPT`` built at ``GPTLightningModule(...)`` time: the
CPU RNG state is captured there and restored (in a forked RNG) for the build, so they do not depend on what drew
random numbers in between.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.data import TensorDataset


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 8192
    block_size: int = 256
    n_layer: int = 6
    n_head: int = 8
    n_embd: int = 512
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = False
    """Share the token embedding with the LM head (GPT-2 does); off by default so Ψ is the plain sum of layers."""
    head_first: bool = False
    """Register the LM head before the embeddings (same forward): reverse registration order then puts the head,
    whose gradient backward produces first, in the last bucket ([Note: bucket rebuild] in
    ``lightning_zero/dp/rebuild.py``)."""


PRESETS: dict[str, GPTConfig] = {
    "gpt25m": GPTConfig(),
    "tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64),
    # 4.2M parameters: small enough for bf16 autocast on a CPU without bf16 instructions (~2.3 s per sequence pair).
    "small": GPTConfig(vocab_size=2048, block_size=128, n_layer=4, n_head=4, n_embd=256),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError(f"n_embd={config.n_embd} must be divisible by n_head={config.n_head}")
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.proj_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim), the layout scaled_dot_product_attention expects.
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.proj_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        if config.head_first:
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        if not config.head_first:
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2: scale the residual-stream output projections by 1/sqrt(2 * n_layer) so the residual variance
        # does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self, trainable_only: bool = True) -> int:
        """Unique parameters (a tied embedding/LM head counts once): Ψ of the memory floors."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def forward(self, idx: Tensor) -> Tensor:
        """Token ids ``(B, T)`` -> logits ``(B, T, vocab_size)``."""
        t = idx.size(1)
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class GPTLightningModule(L.LightningModule):
    """Next-token cross entropy on ``(idx, targets)`` batches.

    The optimizer is ``AdamW(lr=3e-4, fused=True)`` for every strategy: the fused CPU kernel is ~4x faster than the
    for-loop default, which would otherwise swamp the differences between strategies. It also runs on FSDP2's DTensor
    parameters on CPU (checked: same result as the unsharded model to 6e-8 after 5 steps). ``zero_redundancy=True``
    wraps the same AdamW in torch's ``ZeroRedundancyOptimizer`` (the peer of ``zero1_scratch`` under Lightning's
    ``ddp``). ``hsdp=True`` (under ``ModelParallelStrategy``) shards with FSDP2 over the mesh's second dimension and
    replicates over its first: HSDP.

    ``self.model`` is ``None`` until ``configure_model()`` (called by the Trainer, or by hand before using the module
    without one).
    """

    def __init__(
        self, config: GPTConfig | None = None, lr: float = 3e-4, zero_redundancy: bool = False, hsdp: bool = False
    ) -> None:
        super().__init__()
        self.config = config or GPTConfig()
        self.lr = lr
        self.zero_redundancy = zero_redundancy
        self.hsdp = hsdp
        self.model: GPT | None = None
        # The RNG state the model used to be built from (in __init__): configure_model() builds from it.
        self._init_rng_state = torch.get_rng_state()

    def configure_model(self) -> None:
        """Build the model (first call only) and, under ``ModelParallelStrategy``, shard it with FSDP2."""
        if self.model is None:
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(self._init_rng_state)
                self.model = GPT(self.config)
        mesh = self.device_mesh  # set only by Lightning's ModelParallelStrategy
        if mesh is not None and not isinstance(self.model, FSDPModule):
            policy = MixedPrecisionPolicy()  # FSDP2's default: fp32 throughout
            if self.trainer.precision == "bf16-mixed":
                # Lightning's bf16-mixed plugin only adds autocast around the fp32 model, which FSDP2 would still
                # gather in fp32. This gathers bf16 copies of the fp32 shards, as lightning_zero's ZeRO stages do
                # under bf16-mixed, and reduces the gradients in fp32, as they do.
                policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            # HSDP: the whole 2-D mesh, FSDP2's (replicate, shard) order: replicated across "data_parallel", sharded
            # over "tensor_parallel" (consecutive ranks: inside a node).
            shard_mesh = mesh if self.hsdp else mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=shard_mesh, mp_policy=policy)
            fully_shard(self.model, mesh=shard_mesh, mp_policy=policy)

    def forward(self, idx: Tensor) -> Tensor:
        if self.model is None:
            raise RuntimeError("GPTLightningModule.configure_model() has not been called")
        return self.model(idx)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        idx, targets = batch
        logits = self(idx)
        # No self.log: logging with sync_dist would add a collective per step to some strategies and not others.
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.zero_redundancy:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.AdamW, lr=self.lr, fused=True)
        return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)


def random_token_dataset(num_samples: int, block_size: int, vocab_size: int, seed: int = 0) -> TensorDataset:
    """``num_samples`` random sequences as ``(idx, targets)`` pairs, ``targets`` = ``idx`` shifted by one token.

    Drawn from a private ``torch.Generator``, so the data is the same in every process and every run whatever the
    global RNG state.
    """
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (num_samples, block_size + 1), generator=generator)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def build_config(preset: str = "gpt25m", **overrides: object) -> GPTConfig:
    """A preset from :data:`PRESETS` with field overrides (e.g. ``tie_weights=True``)."""
    return replace(PRESETS[preset], **overrides)


if __name__ == "__main__":
    for name, preset in PRESETS.items():
        for tied in (False, True):
            n = GPT(replace(preset, tie_weights=tied)).num_parameters()
            print(f"{name:>7} tie_weights={tied!s:<5} {n:>12,} trainable parameters ({n / 1e6:.2f}M)")
