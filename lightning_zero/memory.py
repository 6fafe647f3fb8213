"""The memory ledger: per-rank model-state bytes, counted exactly by walking tensors and summing unique storages.

Each storage is counted once, in the first category that reaches it, in this order: parameters, gradients, optimizer
state, strategy buffers. So a gradient that is a view of a strategy bucket counts as a gradient, and the bucket adds
only what no gradient covers. ``p.grad`` is read explicitly (a ``gc`` walk would miss it: it has no Python object
until read).

Reference floors for fp32 AdamW, Ψ trainable parameters, N ranks: DDP 16Ψ, ZeRO-1 8Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N,
ZeRO-3 16Ψ/N bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ModelStateBytes:
    params: int
    grads: int
    optimizer: int
    strategy_buffers: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.strategy_buffers


def _optimizer_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> Iterable[Tensor]:
    for optimizer in optimizers:
        for state in optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, Tensor))


def model_state_bytes(
    params: Iterable[Tensor],
    optimizers: Iterable[torch.optim.Optimizer] = (),
    strategy_buffers: Iterable[Tensor] = (),
) -> ModelStateBytes:
    """Bytes of unique storages held by ``params``, their ``.grad``, the optimizers' state and strategy buffers."""
    seen: set[tuple[torch.device, int]] = set()

    def count(tensors: Iterable[Tensor]) -> int:
        total = 0
        for tensor in tensors:
            storage = tensor.untyped_storage()
            key = (tensor.device, storage.data_ptr())
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
        return total

    params = list(params)
    return ModelStateBytes(
        params=count(params),
        grads=count(p.grad for p in params if p.grad is not None),
        optimizer=count(_optimizer_tensors(optimizers)),
        strategy_buffers=count(strategy_buffers),
    )
