"""The memory ledger: per-rank model-state bytes, counted exactly by walking tensors and summing unique storages.

Each storage is counted once, in the first category that reaches it, in this order: parameters, gradients, optimizer
state, strategy buffers. So a gradient that is a view of a strategy bucket counts as a gradient, and the bucket adds
only what no gradient covers. ``p.grad`` is read explicitly (a ``gc`` walk would miss it: it has no Python object
until read).

Reference floors for fp32 AdamW, Ψ trainable parameters, N ranks: DDP 16Ψ, ZeRO-1 8Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N,
ZeRO-3 16Ψ/N bytes; :func:`zero_model_state_bytes` computes them for any bytes per element (the ZeRO paper's
mixed-precision Adam: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N).

:func:`strategy_model_state_bytes` counts what a Lightning strategy holds on this rank: lightning_zero's strategies
say it themselves (``strategy.model_state_bytes()``, strategy buffers included); for any other strategy the module's
parameters and the optimizers' state are counted, DTensors (FSDP2) by their local shards and torch's
``ZeroRedundancyOptimizer`` by its local optimizer; buffers that live in C++ (torch DDP's buckets) are not visible.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

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

    def as_dict(self) -> dict[str, int]:
        """``{"params", "grads", "optimizer", "strategy_buffers", "total"}`` in bytes."""
        return {**asdict(self), "total": self.total}


def zero_model_state_bytes(
    stage: int,
    psi: float,
    world_size: int,
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes: float = 12,
) -> float:
    """Model-state bytes per rank under ZeRO ``stage`` (0: plain data parallelism), as the ZeRO paper counts them
    (Rajbhandari et al. 2020, section 3): ``param_bytes`` and ``grad_bytes`` per element of the parameters and
    gradients the model computes with, ``optimizer_bytes`` (K) per element of what the optimizer keeps (for Adam,
    fp32 master weights, momentum and variance: K = 12; without master weights K = 8). Stage 1 shards the K term,
    stage 2 the gradients too, stage 3 everything. The defaults are the paper's mixed-precision Adam; fp32 AdamW is
    ``param_bytes=4, grad_bytes=4, optimizer_bytes=8``."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r} is invalid: expected 0 (DDP), 1, 2 or 3")
    if world_size < 1:
        raise ValueError(f"world_size={world_size!r} is invalid: expected an integer >= 1")
    params, grads, optimizer = param_bytes * psi, grad_bytes * psi, optimizer_bytes * psi
    sharded = (optimizer, optimizer + grads, optimizer + grads + params)[stage - 1] if stage else 0
    return params + grads + optimizer - sharded + sharded / world_size


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


def _local(tensor: Tensor) -> Tensor:
    """A DTensor's local shard (``to_local()``, padded as FSDP2 pads it); any other tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def local_shards(params: Iterable[Tensor]) -> list[Tensor]:
    """Aliases of this rank's shard of every parameter, each with this rank's shard of its gradient as ``.grad``.

    ``model_state_bytes`` reads ``p.grad`` of the tensors it is given, and a DTensor's ``untyped_storage()`` is not its
    local shard's, so it is given plain tensors sharing the shards' storages. Plain parameters give plain aliases of the
    same storages, so the count is the same as for the parameters themselves.
    """
    shards = []
    with torch.no_grad():
        for p in params:
            shard = _local(p).detach()
            if p.grad is not None:
                shard.grad = _local(p.grad)
            shards.append(shard)
    return shards


class LocalOptimizerState:  # duck-typed for model_state_bytes, which reads only .state
    """What ``model_state_bytes`` reads of an optimizer (``.state``), with every DTensor replaced by its local shard."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.state = {
            p: {k: _local(v) if isinstance(v, Tensor) else v for k, v in s.items()} for p, s in optimizer.state.items()
        }


def _local_optimizer(optimizer: Any) -> Any:
    """torch's ``ZeroRedundancyOptimizer`` keeps this rank's state in its local optimizer, ``.optim``."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def strategy_model_state_bytes(strategy: Any) -> ModelStateBytes:
    """This rank's model-state bytes under a Lightning ``strategy`` (while fitting, before its teardown).

    A strategy that counts its own (lightning_zero's: ``strategy.model_state_bytes()``, with its flat buffers and
    buckets as ``strategy_buffers``) is asked. Otherwise the LightningModule's parameters, their gradients and the
    optimizers' state are counted, by local shard for DTensors; such a strategy's own buffers are not visible here
    (``strategy_buffers`` is 0).
    """
    own = getattr(strategy, "model_state_bytes", None)
    if callable(own):
        return own()
    module = strategy.lightning_module
    params = module.parameters() if module is not None else ()
    optimizers = [LocalOptimizerState(_local_optimizer(o)) for o in strategy.optimizers]
    return model_state_bytes(local_shards(params), optimizers)
