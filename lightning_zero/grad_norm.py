"""Gradient norms from gradient shards: global-norm clipping under ZeRO, and what
``lightning.pytorch.utilities.grad_norm`` gives under ``ddp`` under every strategy.

Under ZeRO stage 2 and 3 (and stage 1 with ``grad_sync="microbatch"``) ``p.grad`` is ``None`` when
``on_before_optimizer_step`` runs: the averaged gradient exists only as each rank's shard of it. Use this function
instead of Lightning's, on every rank (it is collective under ZeRO)::

    from lightning_zero import grad_norm

    def on_before_optimizer_step(self, optimizer):
        self.log_dict(grad_norm(self, norm_type=2))

It returns the same keys (``grad_2.0_norm/<name>`` for each parameter that has a gradient under ``ddp``, and
``grad_2.0_norm_total``) and the same values: each rank adds up ``|g|^p`` over its pieces of each parameter and one
all-reduce completes them. Under the other strategies it is Lightning's ``grad_norm``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import Tensor, nn

from lightning_zero import collectives as comm
from lightning_zero.unused import ParamPieces


def clip_grad_norm_(grads: list[Tensor], max_norm: float, *, group: object, device: torch.device) -> Tensor:
    """Scale this rank's gradient shards so the *global* norm is at most ``max_norm``; return that norm.

    Same formula as ``torch.nn.utils.clip_grad_norm_``; shards are disjoint and padding is zero, so the sum of
    per-rank squared norms is the squared norm of the whole gradient (one scalar all-reduce).
    """
    squared = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads:
        squared += grad.detach().float().pow(2).sum()
    comm.all_reduce(squared, "sum", group=group, tag="clip_norm")
    total = squared.sqrt()
    coef = max_norm / (total.item() + 1e-6)
    if coef < 1.0 and math.isfinite(coef):
        for grad in grads:
            grad.mul_(coef)
    return total


def shard_grad_norms(
    params: list[ParamPieces], norm_type: float, *, group: object, device: torch.device
) -> list[Tensor]:
    """The norm of each parameter's *whole* gradient from its pieces in every rank's shard (one all-reduce).

    Each rank sums ``|g|^p`` (or takes ``max |g|``) over its pieces of each parameter; the partial results of all ranks
    add up (or max) to the parameter's. Parameters whose group has no gradient yet count as zero.
    """
    infinite = math.isinf(norm_type)
    partial = torch.zeros(len(params), dtype=torch.float64, device=device)
    for i, param in enumerate(params):
        grad = param.shard.grad
        for offset, length in param.pieces if grad is not None else []:
            piece = grad.detach().narrow(0, offset, length).double().abs()
            partial[i] = torch.maximum(partial[i], piece.max()) if infinite else partial[i] + piece.pow(norm_type).sum()
    comm.all_reduce(partial, "max" if infinite else "sum", group=group, tag="grad_norm")
    return list(partial if infinite else partial.pow(1.0 / norm_type))


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, Any]:
    """Each parameter's gradient norm and their overall norm, as ``lightning.pytorch.utilities.grad_norm`` computes
    them from ``p.grad``, under every lightning_zero strategy (see the module docstring)."""
    from lightning_zero.strategies.zero import ZeroStrategy

    trainer = getattr(module, "_trainer", None)
    strategy = trainer.strategy if trainer is not None else None
    if not isinstance(strategy, ZeroStrategy) or strategy.engine is None:
        return lightning_grad_norm(module, norm_type, group_separator)
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type={norm_type!r} is invalid: expected a positive number or 'inf'")
    per_param = strategy.grad_norms(norm_type)
    norms = {
        f"grad_{norm_type}_norm{group_separator}{name}": per_param[name]
        for name, _ in module.named_parameters()
        if name in per_param
    }
    if norms:
        norms[f"grad_{norm_type}_norm_total"] = torch.tensor(list(norms.values())).norm(norm_type)
    return norms
