"""Gradient norms from gradient shards: the global norm for clipping, and each parameter's norm from its pieces in
every rank's shard (what ``lightning_zero.grad_norm`` reports under ZeRO)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_zero.comm import collectives as comm
from lightning_zero.zero.unused import ParamPieces


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
